"""benchmarks/vla_throughput.py's parsing of the baseline's log and its figures (CPU, no training).

The whole benchmark in ``--smoke`` mode (dataset, stand-ins, ``lerobot-train`` and ``loong-embodied train`` rows)
takes minutes on CPU, far over a test's budget, so it is not run here; these tests check the part whose mistakes
would go unseen: reading ``lerobot-train``'s per-step line as lerobot's own ``MetricsTracker`` prints it, and the
medians / samples/s / table built from the per-step figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def rows_module():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import vla_rows
        import vla_throughput

        yield vla_rows, vla_throughput
    finally:
        sys.path.remove(str(BENCHMARKS))


def _lerobot_line(step: int, loss: float, updt: float, data: float, mem: float) -> str:
    """One log line of lerobot-train (``lerobot_train.py``'s meters, printed by lerobot's own MetricsTracker)."""
    from lerobot.utils.logging_utils import AverageMeter, MetricsTracker

    meters = {"loss": AverageMeter("loss", ":.3f", reduction="mean"), "grad_norm": AverageMeter("grdn", ":.3f"),
              "lr": AverageMeter("lr", ":0.1e"), "update_s": AverageMeter("updt_s", ":.3f", reduction="max"),
              "dataloading_s": AverageMeter("data_s", ":.3f", reduction="max"),
              "samples_per_s": AverageMeter("smp/s", ":.0f"), "gpu_mem_gb": AverageMeter("mem_gb", ":.2f")}
    tracker = MetricsTracker(32, 1626, 12, meters, initial_step=step - 1)
    tracker.loss, tracker.grad_norm, tracker.lr = loss, 1.5, 2.5e-5
    tracker.update_s, tracker.dataloading_s, tracker.gpu_mem_gb = updt, data, mem
    tracker.samples_per_s = 32 / (updt + data)
    tracker.update_metrics({"action_loss": 0.7})  # a policy output the trainer adds to the line
    tracker.step()
    return f"INFO 2026-12-02 05:40:{step:02d} ot_train.py:651 {tracker}"


def test_parse_lerobot_log_reads_lerobots_own_line(rows_module):
    vla_rows, _ = rows_module
    log = "\n".join(["Training:   0%|          | 0/3", "INFO 2026-12-02 05:39:59 ot_train.py:420 cfg.steps=3",
                     _lerobot_line(1, 2.25, 5.125, 3.5, 70.25), _lerobot_line(2, 1.875, 0.875, 0.0125, 136.0)])
    recs = vla_rows.parse_lerobot_log(log)
    assert [r["loss"] for r in recs] == [2.25, 1.875]
    assert [r["updt_s"] for r in recs] == [5.125, 0.875]
    assert [r["data_s"] for r in recs] == [3.5, 0.013]  # lerobot prints 3 decimals
    assert [r["mem_gb"] for r in recs] == [70.25, 136.0]


def test_figures_take_medians_after_warmup(rows_module):
    vla_rows, _ = rows_module
    f = vla_rows.figures([9.0, 1.0, 0.5, 0.75], [5.0, 0.02, 0.01, None], [3.0, 2.0, 1.0, 0.5], warmup=1, batch=32,
                         peak_gib=10.0, peak_source="test", smi_gib=None)
    assert f["s_per_step"] == 0.75 and f["samples_per_s"] == pytest.approx(32 / 0.75, abs=0.01)
    assert f["data_wait_s"] == 0.015  # the median of the logged waits after warm-up
    assert f["loss_last"] == 0.5
    with pytest.raises(RuntimeError, match="warmup"):
        vla_rows.figures([1.0], [None], [1.0], warmup=1, batch=2, peak_gib=None, peak_source="", smi_gib=None)


def test_table_compares_with_the_lerobot_row(rows_module):
    _, bench = rows_module
    base = {"s_per_step": 0.8, "samples_per_s": 40.0, "data_wait_s": 0.01, "peak_memory_gib": 100.0,
            "nvidia_smi_peak_gib": 110.0, "loss_last": 1.0}
    rows = {"pi05/lerobot": base, "pi05/loong": {**base, "samples_per_s": 100.0, "peak_memory_gib": 50.0},
            "groot_n1_6/loong": {"error": "Traceback ...\nRuntimeError: boom"}}
    lines = bench.table(rows)
    loong = next(line for line in lines if "loong-embodied" in line and "failed" not in line)
    assert "2.50x" in loong and "0.50x" in loong
    assert any("failed: RuntimeError: boom" in line for line in lines)
