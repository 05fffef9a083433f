"""Fault tolerance on the GPU (``pytest -m gpu``): async saving, SIGKILL mid-run, resume.

The same harness as ``test_fault_tolerance.py`` (``workers/fault_run.py`` in a subprocess), on CUDA in
bf16: a run with ``train.async_save=true`` is killed inside a forward pass and resumed; its final
checkpoint is compared with the uninterrupted run's. Bitwise equality is reported, and required within
bf16 rounding (GPU kernels need not be bit-reproducible; see docs/checkpoints.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_fault_tolerance import _launch  # noqa: E402  (the CPU harness, same folder)

from loong.core.checkpoint.inspect import checkpoint_tensors  # noqa: E402

pytestmark = pytest.mark.gpu


def test_async_save_kill_and_resume_on_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.fail("gpu tests need CUDA")
    extra = ["train.async_save=true", "model.hidden_size=256", "model.ffn_hidden_size=512"]
    rc, log = _launch("none", tmp_path, "ref", "tp1", *extra)
    assert rc == 0, log[-3000:]
    rc, log = _launch("forward:5", tmp_path, "killed", "tp1", *extra)
    assert rc != 0
    rc, log = _launch("none", tmp_path, "killed", "tp1", *extra)
    assert rc == 0 and "resumed from" in log, log[-3000:]
    assert "(cuda," in log
    a = checkpoint_tensors(tmp_path / "ref" / "checkpoints" / "step_00000006")
    b = checkpoint_tensors(tmp_path / "killed" / "checkpoints" / "step_00000006")
    assert sorted(a) == sorted(b)
    identical = sum(torch.equal(a[k], b[k]) for k in a)
    print(f"{identical}/{len(a)} tensors bitwise identical after kill + resume on GPU")
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), rtol=2e-2, atol=2e-3, msg=k)
