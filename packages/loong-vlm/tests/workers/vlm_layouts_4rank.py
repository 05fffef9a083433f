"""Worker of ``test_vlm_layouts_4rank.py``: the VLM layouts that need four ranks, against DP=4 (gloo, fp32).

Launched as ``python -m torch.distributed.run --standalone --nproc-per-node=4 vlm_layouts_4rank.py ROOT``. From
DP=4's initial weights (its first step is the reference) it runs:

- one step of each layout in ``STEP_LAYOUTS`` against its DP=4 reference: the decoupled tower at PP=2 x TP=2 sharded
  at encoder TP=2 (each stage's replica over its own group), CP=2 x TP=2 with encoder TP=2 (the encoder group inside
  TP, CP outside), and foundation TP=4 with the encoder at TP=2 (two replicas of the sharded tower in the
  foundation's TP group) and at TP=1 (four whole replicas), on the tiny foundation widened to 8 heads in 4 query
  groups (``KV4``: TP=4 must divide the KV heads; its own DP=4 reference), and those two with sequence parallelism
  (the step-0 rows are packed, 2-3 conversations each, their visual tokens in 2-3 of the 4 slices); with each
  step's gradient norm and how far the tower's replicas in a foundation-TP group are apart in their gradients;
- three training steps of DP=4 and of the decoupled PP=2 x DP=2 tower with ``train.distributed_optimizer=true``:
  the replicas' gradients must be summed over the pipeline group *before* the data-parallel reduce-scatter (after
  it each rank holds only its slice of a buffer in which the tower sits at a different place on each stage).

Rank 0 saves the figures to ``ROOT/result.pt``; the pytest side compares them. The functions are the 2-rank
worker's (``vlm_layouts.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from vlm_layouts import _grad_err, _grad_norms, build, fit_and_losses, one_step  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.engines.megatron.state import gather_full_state, unwrap  # noqa: E402

#: the tiny foundation with 8 heads in 4 query groups (its 2 KV heads do not split over TP=4); GQA kept, head_dim 16
#: as before (M-RoPE's sections)
KV4 = ["foundation.num_attention_heads=8", "foundation.num_query_groups=4", "foundation.head_dim=16"]
REFERENCES = {"dp4": ["parallel.tp=1"], "dp4_kv4": [*KV4, "parallel.tp=1"]}
STEP_LAYOUTS = {  # name: (overrides, the name of its DP=4 reference)
    "pp2_tp2_decoupled_encoder_tp2": (["parallel.pp=2", "parallel.tp=2", "encoder.decoupled=true",
                                       "encoder.parallel.tp=2"], "dp4"),
    "cp2_tp2_encoder_tp2": (["parallel.cp=2", "parallel.tp=2", "encoder.parallel.tp=2"], "dp4"),
    "tp4_encoder_tp2": ([*KV4, "parallel.tp=4", "encoder.parallel.tp=2"], "dp4_kv4"),
    "tp4_encoder_tp1": ([*KV4, "parallel.tp=4"], "dp4_kv4"),
    "tp4sp_encoder_tp2": ([*KV4, "parallel.tp=4", "parallel.sequence_parallel=true", "encoder.parallel.tp=2"],
                          "dp4_kv4"),
    "tp4sp_encoder_tp1": ([*KV4, "parallel.tp=4", "parallel.sequence_parallel=true"], "dp4_kv4"),
}
FIT_LAYOUTS = {
    "dp4": ["parallel.tp=1"],
    "pp2_decoupled_distributed_optimizer": ["parallel.pp=2", "encoder.decoupled=true",
                                            "train.distributed_optimizer=true"],
}
FIT_STEPS = 3


def tower_probe(engine) -> dict:  # noqa: ANN001
    """The step's gradient norm as megatron's optimiser computes it for ``train.clip_grad`` (each shard once, a
    replicated weight once, ``shared`` ones not), that of the vision tower's gradients alone by the same rules (the
    tower is a small part of the whole norm), and the largest gradient difference, relative to the largest gradient,
    between the tower's replicas in a foundation-TP group (rank ``r``'s encoder and projector gradients against
    those of rank ``r mod encoder.parallel.tp`` of its group: the same shard of the first replica).
    ``gather_full_state`` reads only the first replica, so a replica with other gradients would pass its check.
    Collective over the world."""
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    opt = engine.optimizer
    opt.prepare_grads()  # grad = main_grad, what the norm reads (nothing is changed)
    tp, enc_tp = engine.layout.pg_collection.tp, engine.layout.component("encoder").tp.size()
    tower = [p for chunk in engine.model_chunks for name, p in unwrap(chunk).named_parameters()
             if name.startswith(("encoder.", "projector.")) and getattr(p, "main_grad", None) is not None]
    mine = {id(p.grad) for p in tower}
    counted = [g for o in getattr(opt, "chained_optimizers", [opt]) for g in o.get_grads_for_grad_norm()
               if id(g) in mine]  # megatron's filter (shared, tensor-parallel duplicates), on the tower
    spread = 0.0
    for p in tower:
        grads = [torch.empty_like(p.main_grad) for _ in range(tp.size())]
        dist.all_gather(grads, p.main_grad.contiguous(), group=tp)
        for r, g in enumerate(grads):
            first = grads[r % enc_tp]
            spread = max(spread, float((g - first).abs().max() / first.abs().max().clamp(min=1e-12)))
    return {"grad_norm": float(opt.get_grad_norm()), "replica_err": spread,
            "tower_grad_norm": float(get_grad_norm_fp32(counted,
                                                        grad_stats_parallel_group=opt.get_grad_stats_parallel_group()))}


def main() -> None:
    root = Path(sys.argv[1])
    acc = select_accelerator("cpu")
    result: dict = {"loss": {}, "grad_err": {}, "grad_keys_equal": {}, "grad_norm": {}, "tower_grad_norm": {},
                    "replica_err": {}, "reference": {}, "fit": {}}
    with acc.activate(engine="megatron"):
        refs = {name: one_step(root, overrides, acc, probe=tower_probe) for name, overrides in REFERENCES.items()}
        for name, got in refs.items():
            for key in ("loss", "grad_norm", "tower_grad_norm"):
                result[key][name] = got[key]
        for name, (overrides, ref_name) in STEP_LAYOUTS.items():
            ref = refs[ref_name]
            got = one_step(root, overrides, acc, ref["weights"], probe=tower_probe)
            result["reference"][name] = ref_name
            for key in ("loss", "grad_norm", "tower_grad_norm", "replica_err"):
                result[key][name] = got[key]
            result["grad_keys_equal"][name] = sorted(got["grads"]) == sorted(ref["grads"])
            result["grad_err"][name] = _grad_err(got["grads"], ref["grads"])
        ref = refs["dp4"]
        for name, overrides in FIT_LAYOUTS.items():
            cfg, layout, task = build(root, [*overrides, "train.save_final=false"], acc, steps=FIT_STEPS)
            losses, records, engine = fit_and_losses(cfg, layout, task, acc, root / name, weights=ref["weights"])
            result["fit"][name] = {"losses": losses, "grad_norms": _grad_norms(records),
                                   "weights": gather_full_state(engine.model_chunks)}
    if dist.get_rank() == 0:
        torch.save(result, root / "result.pt")


if __name__ == "__main__":
    main()
