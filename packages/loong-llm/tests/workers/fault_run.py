"""A training run through the real walk (``loong.core.run.train``) that fails at a chosen moment.

Run as ``python fault_run.py FAULT override...`` (a world of one) or under ``torchrun``. FAULT is
``none`` or ``KIND:STEP`` (1-based step), injected by a test-only task (``test.faulty``, a
PretrainTask registered here; nothing in the package is patched):

- ``between:N``  SIGKILL right after step N's optimiser update;
- ``forward:N``  SIGKILL inside the forward pass of step N's second micro-batch (rank 0);
- ``save:N``     SIGKILL while the step-N checkpoint is being written: its shards, RNG states and
                 trainer state are on disk, the manifest and the rename are not (rank 0);
- ``raise:N``    an exception in step N's forward on the first attempt only (torchrun's
                 ``TORCHELASTIC_RESTART_COUNT`` is 0): an elastic restart then succeeds;
- ``nan:N``      the loss of step N's batch is NaN every time that batch is trained on;
- ``nangrad:N``  step N's loss stays finite but the final norm's weight gets a NaN gradient;
- ``nanact:N``   step N's loss stays finite but the backward turns the gradient at the final norm's output NaN
                 (as a faulty kernel between modules would).
- ``oom:N``      step N's second micro-batch raises torch's ``OutOfMemoryError`` in the forward (rank 0).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from loong.core.engines.megatron.state import unwrap
from loong.core.registry import TASKS
from loong.core.run import train
from loong.llm.pretrain import PretrainTask
from loong.llm.schema import LLMRunConfig

FAULT = "none"


def _fault() -> tuple[str, int]:
    kind, _, step = FAULT.partition(":")
    return kind, int(step or 0)


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


class _NaNGradient(torch.autograd.Function):
    """Identity forward; a NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return torch.full_like(g, float("nan"))


@TASKS.register("test.faulty")
class FaultyTask(PretrainTask):
    """Pretraining with one injected fault (see the module docstring)."""

    _batch = -1
    _micro = 0

    def train_microbatches(self, step, num_microbatches):  # noqa: ANN001, ANN201
        self._batch, self._micro = step, 0
        return super().train_microbatches(step, num_microbatches)

    def forward_step(self, data_iterator, model):  # noqa: ANN001, ANN201
        kind, n = _fault()
        self._micro += 1
        if model.training and self._batch == n - 1 and self._micro == 2:
            if kind == "forward" and _rank0():
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "raise" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and _rank0():
                raise RuntimeError("injected worker failure")
            if kind == "oom" and _rank0():
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB (injected)")
        hook = None
        if kind == "nanact" and model.training and self._batch == n - 1:
            norm = unwrap(model).decoder.final_layernorm
            hook = norm.register_forward_hook(lambda _m, _a, out: _NaNGradient.apply(out))
        try:
            output, loss_func = super().forward_step(data_iterator, model)
        finally:
            if hook is not None:
                hook.remove()
        if kind == "nan" and model.training and self._batch == n - 1:
            output = output * torch.tensor(float("nan"))
        if kind == "nangrad" and model.training and self._batch == n - 1:
            weight = unwrap(model).decoder.final_layernorm.weight
            output = output + 0.0 * _NaNGradient.apply(weight).sum()  # a finite loss, a NaN gradient
        return output, loss_func

    def after_train_step(self, step, extra):  # noqa: ANN001, ANN201
        kind, n = _fault()
        if kind == "between" and step == n - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().after_train_step(step, extra)

    def save_artifacts(self, checkpoint_dir):  # noqa: ANN001, ANN201
        kind, n = _fault()
        if kind == "save" and checkpoint_dir.name == f".step_{n:08d}.tmp":
            os.kill(os.getpid(), signal.SIGKILL)
        super().save_artifacts(checkpoint_dir)


def main() -> None:
    global FAULT
    FAULT = sys.argv[1]
    result = train("loong.llm.configs", "pretrain", ["task=test.faulty", *sys.argv[2:]], LLMRunConfig,
                   echo=lambda m: print(m, flush=True))
    if result.is_logging_rank:
        print(f"finished at step {result.last_step}", flush=True)


if __name__ == "__main__":
    main()
