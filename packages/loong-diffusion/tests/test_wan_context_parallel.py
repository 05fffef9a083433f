"""Wan with context parallelism equals Wan without it: one launch of 2 gloo processes (``workers/wan_cp.py``) runs
Ulysses=2 and ring=2 (T2V), Ulysses=2 for TI2V (per-token timesteps) and I2V (image K/V), and compares the
prediction and every parameter gradient (summed over the CP ranks) with CP=1, for a loss on the gathered prediction
and for a loss on each rank's token shard."""

from __future__ import annotations

import pytest
from wan_testing import torchrun_report

#: fp32; relative to the largest reference value of each tensor (measured: outputs equal or ~1e-7, gradients
#: ~5e-7; gradients reach ~100, where one float32 step is 1.5e-5, so an absolute bound would measure their scale)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def cp_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return torchrun_report("wan_cp.py", tmp_path_factory.mktemp("wan_cp") / "report.json")


@pytest.mark.slow
def test_cp2_matches_cp1_in_prediction_and_every_gradient(cp_report: dict) -> None:
    assert set(cp_report) == {"ulysses2/t2v", "ring2/t2v", "ulysses2/ti2v", "ulysses2/i2v"}
    for case, errors in cp_report.items():
        assert errors["tokens_per_rank"] == 18, case  # 36 tokens over 2 ranks
        for key in ("out", "shard_out", "grads", "shard_grads"):
            assert errors[key] <= TOLERANCE, (case, key, errors[key])
