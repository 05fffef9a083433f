"""Worker of ``test_vlm_layouts_4rank.py``: the VLM layouts that need four ranks, against DP=4 (gloo, fp32).

Launched as ``python -m torch.distributed.run --standalone --nproc-per-node=4 vlm_layouts_4rank.py ROOT``. From
DP=4's initial weights (its first step is the reference) it runs:

- one step of each layout in ``STEP_LAYOUTS``: the decoupled tower at PP=2 x TP=2 sharded at encoder TP=2 (each
  stage's replica over its own group), and CP=2 x TP=2 with encoder TP=2 (the encoder group inside TP, CP outside);
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
from loong.core.engines.megatron.state import gather_full_state  # noqa: E402

STEP_LAYOUTS = {
    "pp2_tp2_decoupled_encoder_tp2": ["parallel.pp=2", "parallel.tp=2", "encoder.decoupled=true",
                                      "encoder.parallel.tp=2"],
    "cp2_tp2_encoder_tp2": ["parallel.cp=2", "parallel.tp=2", "encoder.parallel.tp=2"],
}
FIT_LAYOUTS = {
    "dp4": ["parallel.tp=1"],
    "pp2_decoupled_distributed_optimizer": ["parallel.pp=2", "encoder.decoupled=true",
                                            "train.distributed_optimizer=true"],
}
FIT_STEPS = 3


def main() -> None:
    root = Path(sys.argv[1])
    acc = select_accelerator("cpu")
    result: dict = {"loss": {}, "grad_err": {}, "grad_keys_equal": {}, "fit": {}}
    with acc.activate(engine="megatron"):
        ref = one_step(root, ["parallel.tp=1"], acc)
        result["loss"]["dp4"] = ref["loss"]
        for name, overrides in STEP_LAYOUTS.items():
            got = one_step(root, overrides, acc, ref["weights"])
            result["loss"][name] = got["loss"]
            result["grad_keys_equal"][name] = sorted(got["grads"]) == sorted(ref["grads"])
            result["grad_err"][name] = _grad_err(got["grads"], ref["grads"])
        for name, overrides in FIT_LAYOUTS.items():
            cfg, layout, task = build(root, [*overrides, "train.save_final=false"], acc, steps=FIT_STEPS)
            losses, records, engine = fit_and_losses(cfg, layout, task, acc, root / name, weights=ref["weights"])
            result["fit"][name] = {"losses": losses, "grad_norms": _grad_norms(records),
                                   "weights": gather_full_state(engine.model_chunks)}
    if dist.get_rank() == 0:
        torch.save(result, root / "result.pt")


if __name__ == "__main__":
    main()
