"""Packed, DP-balanced steps on 2 gloo processes equal one process over the same global batch unpacked: one launch
(``workers/wan_pack.py``) trains two steps and evaluates with mixed ``data.sizes`` under ``data.pack_tokens`` for data
parallelism over 2 ranks (the core planner's split of the clips), Ulysses=2 and ring=2 (one pack sharded over both
ranks, padded to an even length), and compares the loss, the evaluation loss and every parameter gradient with the
clips' separate MSEs through a plain model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: fp32, relative to the reference (gradients: to each tensor's largest entry; measured ~1e-7 and ~1e-6)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def pack_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("wan_pack") / "report.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(Path(__file__).parent / "workers" / "wan_pack.py"), str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_packed_balanced_steps_on_two_ranks_equal_one_unpacked_process(pack_report: dict) -> None:
    assert set(pack_report) == {"dp2", "ulysses2", "ring2"}
    for case, r in pack_report.items():
        assert r["eval"] <= TOLERANCE, (case, r["eval"])
        assert len(r["steps"]) == 2, case
        for step in r["steps"]:
            assert step["params"] > 20, case
            for key in ("loss", "grads"):
                assert step[key] <= TOLERANCE, (case, key, step[key])
    first, second = pack_report["dp2"]["steps"]
    assert len(set(first["tokens"])) >= 3  # the step mixes sizes
    for step in (first, second):
        assert len(step["ranks"]) == 2 and all(any(rank) for rank in step["ranks"])  # each rank trains its share
        assert sorted(p for rank in step["ranks"] for mb in rank for p in mb) == list(range(8))
    assert [] in second["ranks"][1]  # an empty micro-batch: the rank runs a weightless clip, the step is exact
    assert pack_report["ulysses2"]["steps"][0]["micro_batches"] >= 2  # 8 clips over budgets of 70 tokens
