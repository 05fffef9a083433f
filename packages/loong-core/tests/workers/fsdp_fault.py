"""A toy run on the fsdp engine through the real walk (``loong.core.run.run``) that is killed at a chosen moment.

``python fsdp_fault.py FAULT OUT NAME LAYOUT`` (a world of one) or under ``torchrun``. FAULT is ``none`` or
``KIND:STEP`` (1-based), injected by a test-only task (nothing in the package is patched):

- ``forward:N``  SIGKILL inside the loss of step N's second micro-batch (rank 0);
- ``save:N``     SIGKILL while the step-N checkpoint is being written: its shards and RNG states are on disk,
                 the manifest and the rename are not (rank 0).

LAYOUT: ``single`` / ``dp2`` (FSDP over two ranks) / ``hybrid`` (HSDP 2x1), with ``-async`` for
``train.async_save=true``. 6 steps of 4 micro-batches, a checkpoint every 2 steps, ``train.resume=auto``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from toy_tasks import ToyLlamaTask, toy_config  # noqa: E402

from loong.core.registry import TASKS  # noqa: E402
from loong.core.run import run  # noqa: E402

FAULT = ("none", 0)
STEPS = 6
LAYOUTS = {"single": {}, "dp2": {"fsdp": "full"}, "hybrid": {"fsdp": "hybrid", "dp_replicate": 2}}


@TASKS.register("test.faulty_toy")
class FaultyToyTask(ToyLlamaTask):
    """The toy LLaMA task with one injected fault (see the module docstring)."""

    _batch, _micro = -1, 0

    def train_microbatches(self, step, num_microbatches):  # noqa: ANN001, ANN201
        self._batch, self._micro = step, 0
        return super().train_microbatches(step, num_microbatches)

    def loss(self, model, batch):  # noqa: ANN001, ANN201
        kind, n = FAULT
        self._micro += 1
        if kind == "forward" and model.training and self._batch == n - 1 and self._micro == 2 \
                and os.environ.get("RANK", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch)

    def save_artifacts(self, checkpoint_dir):  # noqa: ANN001, ANN201
        kind, n = FAULT
        if kind == "save" and checkpoint_dir.name == f".step_{n:08d}.tmp":
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    global FAULT
    fault, out, name, layout = sys.argv[1:5]
    kind, _, step = fault.partition(":")
    FAULT = (kind, int(step or 0))
    base, _, mode = layout.partition("-")
    cfg = toy_config(task="test.faulty_toy", parallel=LAYOUTS[base], output_dir=out, run_name=name,
                     train={"steps": STEPS, "save_interval": 2, "async_save": mode == "async", "resume": "auto"})
    result = run(cfg, echo=lambda m: print(m, flush=True))
    if result.is_logging_rank:
        print(f"finished at step {result.last_step}", flush=True)


if __name__ == "__main__":
    main()
