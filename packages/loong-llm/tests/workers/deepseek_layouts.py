"""DeepSeek-V3 layout checks, run as ``torchrun --nproc-per-node 2 deepseek_layouts.py HF_DIR OUT_JSON``.

One 2-process gloo launch: the same HF-initialised tiny DeepSeek-V3 (MLA, 1 dense + 2 MoE layers with a shared
expert, sigmoid group-limited routing with expert bias, one MTP module) gives, at TP=1 (DP=2; the single-rank
reference, data-parallel), EP=2, TP=2 × EP=2 (ETP=1, sequence parallel), TP=2 with ETP=1 and CP=2 (context
parallelism: MLA's queries against all-gathered keys, MTP's labels rolled across the CP ranks), the loss and every
gradient of one step (the MTP and sequence-balance losses' gradients included); then 3 training steps at TP=1,
TP=2 × EP=2 and CP=2 with ``train.save_hf`` (the expert bias moves by megatron's aux-loss-free update), logging ``mtp_loss``.
Rank 0 writes JSON; the pytest side (``test_deepseek_v3.py``) compares. Helpers come from ``layouts.py``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from layouts import build, one_step_grads  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.config.schema import to_dict  # noqa: E402
from loong.core.engines.megatron.engine import MegatronEngine  # noqa: E402
from loong.core.trainer import Trainer  # noqa: E402
from loong.llm.hf_io import read_hf_folder  # noqa: E402

STEPS = 3
LAYOUTS = {
    "ref": ["parallel.tp=1"],
    "ep2": ["parallel.ep=2"],
    "tp2ep2": ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
    "tp2etp1": ["parallel.tp=2", "parallel.etp=1"],
    "cp2": ["parallel.cp=2"],
}


def _clear_trackers() -> None:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    get_moe_metrics_tracker().clear()  # one_step_grads bypasses the task's per-step report
    MTPLossLoggingHelper.clean_metrics_in_tracker()


def train(hf_dir: str, name: str, run_dir: Path, acc) -> tuple[list[float], float]:  # noqa: ANN001
    cfg, layout, task = build(hf_dir, LAYOUTS[name], ["train.save_hf=true"], acc, steps=STEPS)
    engine = MegatronEngine(task, cfg, acc, layout)
    Trainer(cfg, to_dict(cfg), task, engine, layout, acc, run_dir).fit(0)
    losses, mtp = [float("-inf")] * STEPS, float("-inf")
    if layout.is_logging_rank:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "train_loss" in rec:
                losses[rec["step"] - 1] = rec["train_loss"]
                if rec["step"] == 1:
                    mtp = rec.get("mtp_loss", float("-inf"))
    t = torch.tensor([*losses, mtp])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[:STEPS].tolist(), float(t[STEPS])


def run(hf_dir: str, out: Path) -> None:
    """Every check above; rank 0 writes the JSON to ``out``."""
    acc = select_accelerator("cpu")
    result: dict = {"loss": {}, "grad_err": {}, "grad_worst": {}, "grad_keys_equal": {}, "mtp_grad_nonzero": {},
                    "train": {}, "mtp_loss": {}, "bias_moved": {}, "errors": {}}
    with acc.activate():
        _clear_trackers()
        ref = one_step_grads(hf_dir, LAYOUTS["ref"], acc)
        result["loss"]["ref"] = ref["loss"]
        for name in [n for n in LAYOUTS if n != "ref"]:
            _clear_trackers()
            try:
                got = one_step_grads(hf_dir, LAYOUTS[name], acc)
            except Exception as exc:  # a layout megatron refuses: reported, the test says which
                result["errors"][name] = f"{type(exc).__name__}: {exc}"[:800]
                continue
            result["loss"][name] = got["loss"]
            result["grad_keys_equal"][name] = sorted(got["grads"]) == sorted(ref["grads"])
            errs = {k: float((got["grads"][k] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                    for k, g in ref["grads"].items()}
            worst = max(errs, key=errs.get)
            result["grad_err"][name], result["grad_worst"][name] = errs[worst], worst
            result["mtp_grad_nonzero"][name] = bool(got["grads"]["mtp.layers.0.eh_proj.weight"].abs().sum() > 0)
        _clear_trackers()
        root = Path(tempfile.mkdtemp(prefix="loong-deepseek-layouts-")) if dist.get_rank() == 0 else None
        holder = [str(root)]
        dist.broadcast_object_list(holder, src=0)
        root = Path(holder[0])
        _, start = read_hf_folder(hf_dir)
        biases = {}
        for name in ("ref", "tp2ep2", "cp2"):
            result["train"][name], result["mtp_loss"][name] = train(hf_dir, name, root / name, acc)
            _, saved = read_hf_folder(root / name / "hf")
            keys = [k for k in saved if k.endswith("e_score_correction_bias")]
            biases[name] = torch.stack([saved[k] for k in sorted(keys)])
            result["bias_moved"][name] = not torch.equal(biases[name], torch.stack([start[k] for k in sorted(keys)]))
        result["bias_err"] = float((biases["ref"] - biases["tp2ep2"]).abs().max())
        result["hf_exports"] = {name: str(root / name / "hf") for name in ("ref", "tp2ep2")}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    run(sys.argv[1], Path(sys.argv[2]))
