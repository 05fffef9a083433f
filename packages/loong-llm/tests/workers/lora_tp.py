"""LoRA at TP=2 against TP=1, run as ``torchrun --nproc-per-node 2 lora_tp.py HF_DIR OUT_JSON``.

In one 2-process gloo launch: TP=1 (DP=2) and TP=2 load the same random whole adapters (B non-zero,
so every adapter gets a gradient) into the same HF base weights and give the loss and adapter gradients
of one step; then both train 4 steps from the default initialisation (layout-independent), TP=2 saving
at step 2, which TP=1 resumes. Rank 0 writes everything as JSON; the pytest side compares.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from loong.core.accelerators import select_accelerator
from loong.core.engines.megatron.engine import MegatronEngine
from loong.core.engines.megatron.state import gather_full_state, unwrap
from loong.llm.hf_io import read_hf_folder
from loong.llm.lora import adapter_shapes, is_adapter_key, load_adapter_state
from loong.llm.models.hf_mapping import hf_to_native

sys.path.insert(0, str(Path(__file__).parent))
from layouts import build as layouts_build  # noqa: E402
from layouts import fit_and_losses  # noqa: E402  (a sibling worker script)

STEPS = 4
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def build(hf_dir: str, layout_overrides: list[str], extra: list[str], acc):  # noqa: ANN001, ANN201
    extra = ["train.warmup_steps=0", "train.distributed_optimizer=false", *LORA, *extra]
    return layouts_build(hf_dir, layout_overrides, extra, acc, steps=STEPS, lr="1e-2")


def random_adapters(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Whole adapter tensors, the same at every layout (seeded by the key's position in sorted order)."""
    return {k: 0.1 * torch.randn(shapes[k], generator=torch.Generator().manual_seed(i))
            for i, k in enumerate(sorted(shapes))}


def _max_over_ranks(value: float, mine: bool) -> float:
    t = torch.tensor([value if mine else float("-inf")])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def one_step(hf_dir: str, layout_overrides: list[str], acc) -> dict:  # noqa: ANN001
    cfg, layout, task = build(hf_dir, layout_overrides, [], acc)
    engine = MegatronEngine(task, cfg, acc, layout)
    load_adapter_state(engine.model_chunks, random_adapters(adapter_shapes(engine.model_chunks)))
    for m in engine.model_chunks:
        m.zero_grad_buffer()
    loss = engine._run(engine._iterators(lambda: task.train_microbatches(0, engine.num_microbatches)),
                       forward_only=False)
    grads = gather_full_state(engine.model_chunks, source=lambda p: getattr(p, "main_grad", None))
    trainable = sorted(n for c in engine.model_chunks for n, p in unwrap(c).named_parameters()
                       if p.requires_grad)
    return {"loss": _max_over_ranks(loss, layout.is_logging_rank), "grads": grads,
            "trainable_are_adapters": all(is_adapter_key(n) for n in trainable) and bool(trainable)}


def train(hf_dir: str, layout_overrides: list[str], run_dir: Path, acc, resume: Path | None = None,  # noqa: ANN001
          save_at: int = 0) -> dict:
    cfg, layout, task = build(hf_dir, layout_overrides, [f"train.save_interval={save_at}"], acc)
    losses, engine = fit_and_losses(cfg, layout, task, acc, run_dir, resume, STEPS)
    # base weights after training: bit-identical to the HF weights they were loaded from
    full = gather_full_state(engine.model_chunks)
    base = hf_to_native(read_hf_folder(hf_dir)[1], cfg.model)
    base_equal = all(torch.equal(full[k], v.float()) for k, v in base.items())
    adapters_moved = any(full[k].abs().max() > 0 for k in full if k.endswith(".lora_B.weight"))
    return {"losses": losses, "base_equal": base_equal, "adapters_moved": bool(adapters_moved),
            "keys": sorted(full)}


def main() -> None:
    hf_dir, out = sys.argv[1], Path(sys.argv[2])
    acc = select_accelerator("cpu")
    result: dict = {}
    with acc.activate():
        ref, got = one_step(hf_dir, ["parallel.tp=1"], acc), one_step(hf_dir, ["parallel.tp=2"], acc)
        result["loss"] = {"tp1": ref["loss"], "tp2": got["loss"]}
        result["grad_keys"] = {"tp1": sorted(ref["grads"]), "tp2": sorted(got["grads"])}
        result["grad_err"] = max(
            float((got["grads"][k] - g).abs().max() / g.abs().max().clamp(min=1e-12))
            for k, g in ref["grads"].items()
        )
        result["grad_min_norm"] = min(float(g.norm()) for g in ref["grads"].values())
        result["trainable_are_adapters"] = ref["trainable_are_adapters"] and got["trainable_are_adapters"]
        holder = [tempfile.mkdtemp(prefix="loong-lora-") if dist.get_rank() == 0 else ""]
        dist.broadcast_object_list(holder, src=0)
        root = Path(holder[0])
        result["tp1"] = train(hf_dir, ["parallel.tp=1"], root / "tp1", acc)
        result["tp2"] = train(hf_dir, ["parallel.tp=2"], root / "tp2", acc, save_at=2)
        result["tp1_resumed_from_tp2"] = train(hf_dir, ["parallel.tp=1"], root / "resumed", acc,
                                               resume=root / "tp2" / "checkpoints" / "step_00000002")
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
