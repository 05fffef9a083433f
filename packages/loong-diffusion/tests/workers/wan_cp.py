"""Wan under context parallelism on 2 gloo processes: ``torchrun --nproc-per-node 2 wan_cp.py OUT_JSON``.

Every rank builds the same seeded tiny model twice — without context parallelism, and with CP groups over the two
ranks — runs both on the same inputs and compares: the gathered prediction (``forward``) with the CP=1 one, and
every parameter gradient, summed over the CP ranks, with the CP=1 gradient. Both ways a CP run can be trained: a
loss on the gathered prediction (the same on every rank), and a loss on each rank's own shard of the tokens
(``forward_shard`` against the same shard of the patchified target). Layouts: Ulysses=2 and ring=2 for T2V, Ulysses=2
for TI2V (per-token timesteps, sharded with the tokens) and I2V (image K/V, replicated). Rank 0 writes the largest
errors over both ranks as JSON; the test holds the bounds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder, for wan_testing

import wan_testing  # noqa: E402

from loong.core.attention import cp_groups_from_group, shard_sequence  # noqa: E402
from loong.diffusion.models.wan import WanTransformer  # noqa: E402

CASES = [("ulysses2", "t2v"), ("ring2", "t2v"), ("ulysses2", "ti2v"), ("ulysses2", "i2v")]


def largest(values: list[float]) -> float:
    t = torch.tensor(max(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def summed_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # the CP group is the world here
        grads[name] = g
    return grads


def grad_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(largest relative, largest absolute) error over all parameters."""
    rel = max(wan_testing.relative_error(got[n], want[n]) for n in want)
    absolute = max(float((got[n] - want[n]).abs().max()) for n in want)
    return rel, absolute


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    groups = {"ulysses2": cp_groups_from_group(None, ulysses=2, ring=1),
              "ring2": cp_groups_from_group(None, ulysses=1, ring=2)}
    report = {}
    for layout, variant in CASES:
        config = wan_testing.tiny_config(variant)
        torch.manual_seed(0)
        reference = WanTransformer(config)
        wan_testing.perturb(reference, seed=2)
        model = WanTransformer(config, groups[layout])
        model.load_state_dict(reference.state_dict())
        inputs = wan_testing.wan_inputs(config, seed=3)
        direction = torch.randn(2, config.out_channels, 3, 8, 6, generator=torch.Generator().manual_seed(4))

        want = reference(**inputs)
        (want * direction).sum().backward()
        want_grads = {n: p.grad for n, p in reference.named_parameters()}

        got = model(**inputs)  # the whole prediction, gathered
        (got * direction).sum().backward()
        gathered_rel, gathered_abs = grad_errors(summed_grads(model), want_grads)

        model.zero_grad(set_to_none=True)
        shard = model.forward_shard(**inputs)  # this rank's tokens only
        (shard * shard_sequence(model.patchify(direction), groups[layout], dim=1)).sum().backward()
        shard_rel, shard_abs = grad_errors(summed_grads(model), want_grads)
        want_shard = shard_sequence(reference.patchify(want.detach()), groups[layout], dim=1)

        report[f"{layout}/{variant}"] = {
            "out": largest([wan_testing.relative_error(got.detach(), want.detach())]),
            "shard_out": largest([wan_testing.relative_error(shard.detach(), want_shard)]),
            "grads": largest([gathered_rel]), "grads_abs": largest([gathered_abs]),
            "shard_grads": largest([shard_rel]), "shard_grads_abs": largest([shard_abs]),
            "tokens_per_rank": shard.shape[1],
        }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
