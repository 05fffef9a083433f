"""TP=2, PP=2 and CP=2 reproduce TP=1 (loss, every gradient, 20 steps), and TP=2 checkpoints resume at TP=1.

One 2-process gloo launch runs every layout (see workers/layouts.py); start-up dominates its cost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "layouts.py"


@pytest.fixture(scope="module")
def layouts(tiny_llama_hf: Path, tmp_path_factory: pytest.TempPathFactory, run_workers) -> dict:  # noqa: ANN001
    out = tmp_path_factory.mktemp("layouts") / "result.json"
    run_workers(WORKER, str(tiny_llama_hf), str(out))
    return json.loads(out.read_text())


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "pp2vpp2", "cp2"])
def test_first_step_loss_and_gradients_match_tp1(layouts: dict, layout: str) -> None:
    assert _rel(layouts["loss"][layout], layouts["loss"]["tp1"]) <= 1e-5
    assert layouts["grad_keys_equal"][layout]
    assert layouts["grad_err"][layout] <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "pp2vpp2", "cp2"])
def test_twenty_steps_track_tp1(layouts: dict, layout: str) -> None:
    ref, got = layouts["train"]["tp1"], layouts["train"][layout]
    assert len(ref) == len(got) == 20
    assert max(_rel(a, b) for a, b in zip(got, ref, strict=True)) <= 1e-5
    assert ref[-1] < ref[0]  # it trains


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tp1", "pp2"])
def test_tp2_checkpoint_resumes_at_other_layouts_with_same_next_loss(layouts: dict, target: str) -> None:
    resumed, tp2 = layouts["train"][f"{target}_resumed_from_tp2"], layouts["train"]["tp2"]
    assert resumed[:10] == [float("-inf")] * 10  # steps 1-10 came from the checkpoint
    assert _rel(resumed[10], tp2[10]) <= 1e-5
    assert max(_rel(a, b) for a, b in zip(resumed[10:], tp2[10:], strict=True)) <= 1e-5
