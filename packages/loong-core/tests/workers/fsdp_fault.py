"""A toy run on the fsdp engine through the real walk (``loong.core.run.run``) that is killed at a chosen moment.

``python fsdp_fault.py FAULT OUT NAME LAYOUT`` (a world of one) or under ``torchrun``. FAULT is ``none`` or
``KIND:STEP`` (1-based), injected by a test-only task (nothing in the package is patched):

- ``forward:N``  SIGKILL inside the loss of step N's second micro-batch (rank 0);
- ``save:N``     SIGKILL while the step-N checkpoint is being written: its shards and RNG states are on disk,
                 the manifest and the rename are not (rank 0);
- ``raise:N``    an exception in step N's loss on the first attempt only (torchrun's
                 ``TORCHELASTIC_RESTART_COUNT`` is 0): an elastic restart then succeeds;
- ``term:N``     SIGTERM to this process in step N's loss: the run saves at the step's end and stops;
- ``nan:N``      the loss of step N's batch is NaN every time that batch is trained on;
- ``nangrad:N``  step N's loss stays finite but the final norm's weight gets a NaN gradient;
- ``oom:N``      step N's second micro-batch raises torch's ``OutOfMemoryError`` (rank 0).

LAYOUT: ``single`` / ``dp2`` (FSDP over two ranks) / ``hybrid`` (HSDP 2x1), with ``-async`` for
``train.async_save=true`` or ``-ema`` for ``train.ema_decay=0.9`` (moving averages of the weights). 6 steps of 4 micro-batches, a checkpoint every 2 steps, ``train.resume=auto``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from toy_tasks import ToyLlamaTask, toy_config  # noqa: E402

from loong.core.registry import TASKS  # noqa: E402
from loong.core.run import run  # noqa: E402

FAULT = ("none", 0)
STEPS = 6
LAYOUTS = {"single": {}, "dp2": {"fsdp": "full"}, "hybrid": {"fsdp": "hybrid", "dp_replicate": 2}}


class _NaNGradient(torch.autograd.Function):
    """Identity forward; a NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return torch.full_like(g, float("nan"))


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
        here = model.training and self._batch == n - 1
        rank0 = os.environ.get("RANK", "0") == "0"
        if here and self._micro == 2 and rank0:
            if kind == "forward":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "raise" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                raise RuntimeError("injected worker failure")
            if kind == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB (injected)")
            if kind == "term":
                os.kill(os.getpid(), signal.SIGTERM)
        loss, metrics = super().loss(model, batch)
        if kind == "nan" and here:
            loss = loss * float("nan")
        if kind == "nangrad" and here:
            loss = loss + 0.0 * _NaNGradient.apply(model.norm.weight).sum()  # a finite loss, a NaN gradient
        return loss, metrics

    def save_artifacts(self, checkpoint_dir):  # noqa: ANN001, ANN201
        kind, n = FAULT
        if kind == "save" and checkpoint_dir.name == f".step_{n:08d}.tmp":
            os.kill(os.getpid(), signal.SIGKILL)


def faulty_run(fault: str, out: str, name: str, layout: str, **train: object):  # noqa: ANN201
    """The run (``train``: extra ``train.*`` keys); returns its TrainResult."""
    global FAULT
    kind, _, step = fault.partition(":")
    FAULT = (kind, int(step or 0))
    base, _, mode = layout.partition("-")
    cfg = toy_config(task="test.faulty_toy", parallel=LAYOUTS[base], output_dir=out, run_name=name,
                     train={"steps": STEPS, "save_interval": 2, "async_save": mode == "async", "resume": "auto",
                            "ema_decay": 0.9 if mode == "ema" else 0.0, **train})
    try:
        return run(cfg, echo=lambda m: print(m, flush=True))
    finally:
        FAULT = ("none", 0)


def main() -> None:
    result = faulty_run(*sys.argv[1:5])
    if result.is_logging_rank:
        print(f"finished at step {result.last_step}", flush=True)


if __name__ == "__main__":
    main()
