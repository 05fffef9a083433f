"""The VLM layouts that need four ranks reproduce DP=4 (one 4-process gloo launch, fp32, the tiny model):

- the decoupled tower at PP=2 x TP=2 with the encoder at TP=2, and CP=2 x TP=2 with the encoder at TP=2: the loss
  and every gradient of one step within 1e-5 of DP=4's;
- foundation TP=4 with the encoder at TP=2 (the heterogeneous layout: the tower sharded 2-way, each shard
  replicated on 2 ranks of the foundation's TP group) and at TP=1, on the tiny foundation widened to 8 heads in 4
  query groups (its 2 KV heads do not split 4-way): the loss and every gradient within 1e-5 of DP=4's of that model;
  and both again with sequence parallelism (``parallel.sequence_parallel=true``: each TP rank embeds a quarter of
  every packed row and places only the visual rows that fall in it, whose gradients are summed over the 4 ranks);
- in each of those one-step cases the gradient norm (what ``train.clip_grad`` clips by) and the tower's part of it
  are DP=4's, so duplicate shards (marked ``shared``) and replicated weights count once, and every tower replica
  holds the first one's gradients (the gathered gradients read only the first);
- the decoupled tower at PP=2 x DP=2 with ``train.distributed_optimizer=true``: three steps' losses, gradient norms
  and the weights after them equal DP=4's. (Two ranks cannot show this: PP=2 leaves DP=1, where each rank's
  slice of the gradient buffer is the whole buffer. With the replicas summed after the DP reduce-scatter, as
  megatron's own sum for replicated parameters does, the tower's weights were 5e-3 off after three steps.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_vlm_layouts import launch  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "vlm_layouts_4rank.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return launch(WORKER, tmp_path_factory.mktemp("vlm_layouts_4rank"), 4)


STEP_LAYOUTS = ["pp2_tp2_decoupled_encoder_tp2", "cp2_tp2_encoder_tp2", "tp4_encoder_tp2", "tp4_encoder_tp1",
                "tp4sp_encoder_tp2", "tp4sp_encoder_tp1"]


@pytest.mark.parametrize("layout", STEP_LAYOUTS)
def test_one_step_equals_dp4(layouts: dict, layout: str) -> None:
    ref = layouts["loss"][layouts["reference"][layout]]
    assert abs(layouts["loss"][layout] - ref) / abs(ref) <= 1e-5
    assert layouts["grad_keys_equal"][layout]
    assert layouts["grad_err"][layout] <= 1e-5, layouts["grad_err"]


def test_the_tp4_layouts_are_compared_with_dp4_of_the_same_widened_model(layouts: dict) -> None:
    assert layouts["reference"]["tp4_encoder_tp2"] == layouts["reference"]["tp4_encoder_tp1"] == "dp4_kv4"
    assert layouts["loss"]["dp4_kv4"] != layouts["loss"]["dp4"]  # the override took


@pytest.mark.parametrize("layout", STEP_LAYOUTS)
def test_the_gradient_norm_counts_every_tower_replica_once(layouts: dict, layout: str) -> None:
    """Megatron's norm over the model-parallel group: the encoder shards of the second replica at foundation TP=4
    (``shared``) and the replicated tower weights (counted on TP rank 0) add nothing, so the norm, and the tower's
    part of it alone (where the encoder blocks' shards weigh more), are DP=4's; and the replicas the gathered
    gradients do not read hold the same gradients as the first."""
    ref = layouts["reference"][layout]
    for key in ("grad_norm", "tower_grad_norm"):
        norms = layouts[key]
        assert abs(norms[layout] - norms[ref]) / norms[ref] <= 1e-5, (key, layout, norms)
    assert layouts["replica_err"][layout] <= 1e-5, layouts["replica_err"]


def test_decoupled_tower_with_the_distributed_optimizer_trains_as_dp4(layouts: dict) -> None:
    ref, got = layouts["fit"]["dp4"], layouts["fit"]["pp2_decoupled_distributed_optimizer"]
    assert len(got["losses"]) == len(ref["losses"]) == 3
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) / abs(b) <= 1e-5
    for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True):
        assert abs(a - b) / abs(b) <= 1e-5
    assert sorted(got["weights"]) == sorted(ref["weights"])
    assert any(k.startswith("encoder.") for k in ref["weights"])
    err = max(float((got["weights"][k] - w).abs().max()) for k, w in ref["weights"].items())
    assert err <= 1e-5, err
