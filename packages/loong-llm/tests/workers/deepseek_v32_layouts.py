"""DeepSeek-V3.2 layout check, run as ``torchrun --nproc-per-node 2 deepseek_v32_layouts.py HF_DIR OUT_JSON``.

One 2-process gloo launch: the same HF-initialised tiny DeepSeek-V3.2 (sparse attention with ``index_topk`` below
the sequence length, the lightning indexer's KL loss in the gradient) gives, at TP=1 (DP=2, the single-rank
reference), TP=2 (sequence parallel, heads split, indexer replicated) and CP=2 (context parallel: each rank's two
zigzag chunks of queries select among and attend to the all-gathered keys), the loss and every gradient of one step
(the indexers' included) in both ``dsa_stage``s; then 2 training steps of each layout log ``indexer_loss``.
Rank 0 writes JSON; ``test_deepseek_v32.py`` compares. Helpers come from ``layouts.py``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from layouts import build  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.config.schema import to_dict  # noqa: E402
from loong.core.engines.megatron.engine import MegatronEngine  # noqa: E402
from loong.core.engines.megatron.state import gather_full_state  # noqa: E402
from loong.core.trainer import Trainer  # noqa: E402

STEPS = 2
LAYOUTS = {"ref": ["parallel.tp=1"], "tp2": ["parallel.tp=2"], "cp2": ["parallel.cp=2"]}
STAGES = {"sparse": ["model.dsa_stage=sparse"], "warmup": ["model.dsa_stage=dense_warmup"]}


def _clear() -> None:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from loong.llm.models.deepseek_v32.indexer import clear_indexer_loss_tracker

    get_moe_metrics_tracker().clear()  # one_step_grads bypasses the task's per-step report
    clear_indexer_loss_tracker()


def one_step_grads(hf_dir: str, overrides: list[str], acc) -> dict:  # noqa: ANN001
    """``layouts.one_step_grads``, gathering only trainable parameters' gradients (the warm-up freezes most)."""
    cfg, layout, task = build(hf_dir, overrides, ["train.distributed_optimizer=false"], acc)
    engine = MegatronEngine(task, cfg, acc, layout)
    for m in engine.model_chunks:
        m.zero_grad_buffer()
    loss = engine._run(engine._iterators(lambda: task.train_microbatches(0, engine.num_microbatches)),
                       forward_only=False)
    grads = gather_full_state(engine.model_chunks, source=lambda p: getattr(p, "main_grad", None))
    loss_t = torch.tensor([loss if layout.is_logging_rank else float("-inf")])
    dist.all_reduce(loss_t, op=dist.ReduceOp.MAX)
    return {"loss": float(loss_t), "grads": grads}


def train(hf_dir: str, name: str, run_dir: Path, acc) -> tuple[list[float], list[float]]:  # noqa: ANN001
    cfg, layout, task = build(hf_dir, LAYOUTS[name] + STAGES["sparse"], [], acc, steps=STEPS)
    engine = MegatronEngine(task, cfg, acc, layout)
    Trainer(cfg, to_dict(cfg), task, engine, layout, acc, run_dir).fit(0)
    vals = [float("-inf")] * (2 * STEPS)
    if layout.is_logging_rank:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "train_loss" in rec:
                vals[rec["step"] - 1] = rec["train_loss"]
                vals[STEPS + rec["step"] - 1] = rec.get("indexer_loss", float("-inf"))
    t = torch.tensor(vals)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[:STEPS].tolist(), t[STEPS:].tolist()


def main() -> None:
    hf_dir, out = sys.argv[1], Path(sys.argv[2])
    acc = select_accelerator("cpu")
    result: dict = {"loss": {}, "grad_err": {}, "grad_worst": {}, "grad_keys_equal": {}, "indexer_grad_nonzero": {},
                    "train": {}, "indexer_loss": {}}
    with acc.activate():
        for stage, stage_overrides in STAGES.items():
            got = {}
            for name, layout in LAYOUTS.items():
                _clear()
                got[name] = one_step_grads(hf_dir, layout + stage_overrides, acc)
                result["loss"][f"{stage}_{name}"] = got[name]["loss"]
            ref = got["ref"]["grads"]
            for name in [n for n in LAYOUTS if n != "ref"]:
                grads = got[name]["grads"]
                result["grad_keys_equal"][f"{stage}_{name}"] = sorted(ref) == sorted(grads)
                errs = {k: float((grads[k] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for k, g in ref.items()}
                worst = max(errs, key=errs.get)
                result["grad_err"][f"{stage}_{name}"], result["grad_worst"][f"{stage}_{name}"] = errs[worst], worst
            result["indexer_grad_nonzero"][stage] = bool(
                ref["decoder.layers.1.self_attention.indexer.wq_b.weight"].abs().sum() > 0)
            # the dense warm-up trains nothing but the indexers
            result[f"{stage}_trainable"] = sorted({"indexer" if ".indexer." in k else "other" for k in ref})
        root = Path(tempfile.mkdtemp(prefix="loong-dsv32-layouts-")) if dist.get_rank() == 0 else None
        holder = [str(root)]
        dist.broadcast_object_list(holder, src=0)
        root = Path(holder[0])
        for name in LAYOUTS:
            _clear()
            result["train"][name], result["indexer_loss"][name] = train(hf_dir, name, root / name, acc)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
