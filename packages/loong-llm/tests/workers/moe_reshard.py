"""Optimiser state of a Qwen3-MoE resumed at another EP/TP layout.

Run as ``torchrun --nproc-per-node 2 moe_reshard.py HF_DIR DENSE_HF_DIR ROOT OUT_JSON`` (the
2-rank phase), then ``torchrun --nproc-per-node 1 moe_reshard.py HF_DIR DENSE_HF_DIR ROOT OUT_JSON``
(one rank, reading the 2-rank phase's checkpoint).

2 ranks: 4 Adam steps at EP=2 and at EP=1 (DP=2), each saving at step 2; the Adam moments (gathered to
whole tensors) and step counts are captured as the checkpoint is written. Each checkpoint is then resumed
at other layouts — EP=2 → EP=1, EP=1 → EP=2, EP=2 → TP=2 (sequence parallel, experts TP-split),
EP=1 → TP=2×EP=2 (ETP=1) — and right after the restore the moments are gathered again; the
resumed runs' losses of steps 3 and 4 are recorded beside the uninterrupted run's. Also: an EP=2
checkpoint written the way Loong wrote them before (megatron's ChainedOptimizer keys ``chained_<i>.``)
resumed at EP=1, and a dense model's checkpoint written that way (TP=2) resumed at TP=1. The
distributed optimiser (EP=2) resumed at EP=2, and refused at EP=1.
1 rank: the EP=2 checkpoint resumed at EP=1 on one rank.

Rank 0 writes JSON (per case: losses, the largest moment difference, the step counts); pytest compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from layouts import build  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.config.schema import to_dict  # noqa: E402
from loong.core.engines.megatron.engine import MegatronEngine  # noqa: E402
from loong.core.engines.megatron.state import gather_full_state  # noqa: E402
from loong.core.errors import LoongError  # noqa: E402
from loong.core.trainer import Trainer  # noqa: E402

STEPS, SAVE_AT = 4, 2
MOE = {
    "ep2": ["parallel.ep=2"],
    "ep1": ["parallel.ep=1"],
    "tp2": ["parallel.tp=2"],  # MoE at TP>1 turns sequence parallelism on; ETP=2
    "tp2ep2": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
}
DENSE = {"tp2": ["parallel.tp=2"], "tp1": ["parallel.tp=1"]}


def _parts(engine: MegatronEngine) -> list:
    return list(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]))


def moments(engine: MegatronEngine) -> dict:
    """Whole Adam moments keyed ``exp_avg/<model key>`` (collective) and the set of step counts."""

    def state(p: torch.nn.Parameter) -> dict:
        for part in _parts(engine):
            if p in part.optimizer.state:
                return part.optimizer.state[p]
        return {}

    out = {}
    for name in ("exp_avg", "exp_avg_sq"):
        full = gather_full_state(engine.model_chunks, source=lambda p, n=name: state(p).get(n))
        out.update({f"{name}/{k}": v for k, v in full.items()})
    steps = sorted({float(s["step"]) for part in _parts(engine) for s in part.optimizer.state.values()})
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, steps)
    return {"tensors": out, "steps": sorted({s for r in gathered for s in r}),
            "parts": len(_parts(engine))}


def legacy_save(engine: MegatronEngine, directory: Path) -> None:
    """A checkpoint as Loong wrote it before the layout-independent optimiser form."""
    from megatron.core import dist_checkpointing

    sd = engine._model_sd()
    sd["optimizer"] = engine.optimizer.sharded_state_dict(
        sd, is_loading=False, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    dist_checkpointing.save(sd, str(directory))


def run(hf_dir: str, overrides: list[str], run_dir: Path, acc, resume: Path | None = None,  # noqa: ANN001
        save_at: int = 0, legacy: bool = False) -> dict:
    """Train (or resume) to STEPS; returns the losses and the moments captured at the save (or the restore)."""
    cfg, layout, task = build(hf_dir, overrides, [f"train.save_interval={save_at}", "train.save_final=false"],
                              acc, steps=STEPS)
    engine = MegatronEngine(task, cfg, acc, layout, fresh=resume is None)
    trainer = Trainer(cfg, to_dict(cfg), task, engine, layout, acc, run_dir)
    captured: dict = {}
    save = engine.save

    def capture_and_save(directory: Path) -> None:
        if not captured:
            captured.update(moments(engine))
        legacy_save(engine, directory) if legacy else save(directory)

    engine.save = capture_and_save
    start = 0
    if resume is not None:
        start = trainer.restore(resume)
        captured.update(moments(engine))
    trainer.fit(start)
    losses = [float("-inf")] * STEPS
    if layout.is_logging_rank:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "train_loss" in rec:
                losses[rec["step"] - 1] = rec["train_loss"]
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"losses": t.tolist(), **captured}


def compare(ref: dict, got: dict) -> dict:
    keys_equal = sorted(ref["tensors"]) == sorted(got["tensors"])
    diff = max((float((got["tensors"][k] - v).abs().max()) for k, v in ref["tensors"].items()
                if k in got["tensors"]), default=float("inf"))
    scale = max(float(v.abs().max()) for v in ref["tensors"].values())
    return {"losses": got["losses"], "ref_losses": ref["losses"], "moment_keys_equal": keys_equal,
            "moment_max_diff": diff, "moment_scale": scale, "steps": got["steps"], "ref_steps": ref["steps"],
            "parts": got["parts"], "ref_parts": ref["parts"]}


def ckpt(root: Path, name: str) -> Path:
    return root / name / "checkpoints" / f"step_{SAVE_AT:08d}"


def two_ranks(hf_dir: str, dense_dir: str, root: Path, acc) -> dict:  # noqa: ANN001
    result: dict = {}
    ref = {name: run(hf_dir, MOE[name], root / name, acc, save_at=SAVE_AT) for name in ("ep2", "ep1")}
    ref["legacy_ep2"] = run(hf_dir, MOE["ep2"], root / "legacy_ep2", acc, save_at=SAVE_AT, legacy=True)
    if dist.get_rank() == 0:  # for the one-rank phase
        torch.save({k: ref["ep2"][k] for k in ("tensors", "steps", "parts", "losses")}, root / "ref_ep2.pt")
    cases = [("ep2_to_ep1", "ep2", "ep1"), ("ep1_to_ep2", "ep1", "ep2"), ("ep2_to_tp2", "ep2", "tp2"),
             ("ep1_to_tp2ep2", "ep1", "tp2ep2"),
             ("legacy_ep2_to_ep1", "legacy_ep2", "ep1")]
    for case, src, dst in cases:
        got = run(hf_dir, MOE[dst], root / case, acc, resume=ckpt(root, src))
        result[case] = compare(ref[src], got)
    # the distributed optimiser: exact at its own layout (its Adam step survives the resume), a clear
    # refusal at another EP (its 'dp_reshardable' state is laid out per expert-parallel rank)
    dist_opt = ["train.distributed_optimizer=true"]
    ref["dist_ep2"] = run(hf_dir, MOE["ep2"] + dist_opt, root / "dist_ep2", acc, save_at=SAVE_AT)
    got = run(hf_dir, MOE["ep2"] + dist_opt, root / "dist_ep2_again", acc, resume=ckpt(root, "dist_ep2"))
    result["dist_ep2_to_ep2"] = {"losses": got["losses"], "ref_losses": ref["dist_ep2"]["losses"]}
    try:
        run(hf_dir, MOE["ep1"] + dist_opt, root / "dist_ep2_to_ep1", acc, resume=ckpt(root, "dist_ep2"))
        result["dist_ep2_to_ep1_error"] = None
    except LoongError as exc:
        result["dist_ep2_to_ep1_error"] = str(exc)
    dense_ref = run(dense_dir, DENSE["tp2"], root / "dense_legacy", acc, save_at=SAVE_AT, legacy=True)
    got = run(dense_dir, DENSE["tp1"], root / "dense_legacy_to_tp1", acc, resume=ckpt(root, "dense_legacy"))
    result["dense_legacy_tp2_to_tp1"] = compare(dense_ref, got)
    result["uninterrupted"] = {name: ref[name]["losses"] for name in ref}
    return result


def one_rank(hf_dir: str, root: Path, acc) -> dict:  # noqa: ANN001
    ref = torch.load(root / "ref_ep2.pt", weights_only=True)
    got = run(hf_dir, MOE["ep1"], root / "ep2_to_ep1_one_rank", acc, resume=ckpt(root, "ep2"))
    return {"ep2_to_ep1_one_rank": compare(ref, got)}


def main() -> None:
    hf_dir, dense_dir, root, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    acc = select_accelerator("cpu")
    with acc.activate():
        if int(os.environ["WORLD_SIZE"]) == 1:
            result = one_rank(hf_dir, root, acc)
        else:
            result = two_ranks(hf_dir, dense_dir, root, acc)
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
