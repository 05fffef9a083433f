"""Packed, DP-balanced steps on 2 gloo processes equal one process over the same global batch unpacked: one launch
(``workers/wan_pack.py``) trains two steps and evaluates with mixed ``data.sizes`` under ``data.pack_tokens`` for data
parallelism over 2 ranks (the core planner's split of the clips), Ulysses=2 and ring=2 (one pack sharded over both
ranks, padded to an even length), and compares the loss, the evaluation loss and every parameter gradient with the
clips' separate MSEs through a plain model."""

from __future__ import annotations

import pytest
from wan_testing import torchrun_report

#: fp32, relative to the reference (gradients: to each tensor's largest entry; measured ~1e-7 and ~1e-6)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def pack_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return torchrun_report("wan_pack.py", tmp_path_factory.mktemp("wan_pack") / "report.json")


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
