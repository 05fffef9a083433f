"""The VLM at other layouts reproduces DP=2 (and DP=1): foundation TP=2 (with and without sequence parallelism; the
encoder unsharded on each TP rank), foundation and encoder TP=2 (``encoder.parallel.tp=2``: the ViT's blocks sharded;
the Qwen2.5-VL and the Qwen3-VL towers, and every encoder family's sharding against itself unsharded), PP=2 (the encoder on the first stage), PP=2 with ``encoder.decoupled=true`` (the
tower outside the pipeline, its share computed on every stage), CP=2 (every rank two zigzag chunks of each packed
row, the encoder on all of the micro-batch's media), EP=2 for the Qwen3-VL-MoE foundation, and
data-parallel balancing. Loss and every gradient within 1e-5 (fp32), 10 steps track, a TP=2 checkpoint (the encoder
sharded too) resumes at TP=1 (and back) and a decoupled PP=2 one at coupled PP=2 with the same next loss,
the encoder-TP=2 run's gradient norms are DP=2's, and balancing lowers the predicted rank
imbalance, logged every step.

One 2-process gloo launch (``workers/vlm_layouts.py``) produces every multi-rank figure; the DP=1 reference runs
in this process from the same initial weights.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "workers" / "vlm_layouts.py"
pytestmark = pytest.mark.slow


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _grad_err(got: dict, ref: dict) -> float:
    return max(float((got[k] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for k, g in ref.items())


def launch(worker: Path, root: Path, nproc: int) -> dict:
    """Run ``worker ROOT`` on ``nproc`` gloo processes (torchrun) and return the ``ROOT/result.pt`` it saves."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(worker), str(root)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(root / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("vlm_layouts")
    result = launch(WORKER, root, 2)
    result["root"] = root
    return result


def test_the_gradients_compared_cover_every_component(layouts: dict) -> None:
    grads = layouts["dp2_step"]["grads"]
    for part in ("encoder.", "projector.", "foundation."):
        keys = [k for k in grads if k.startswith(part)]
        assert keys, part
        assert max(float(grads[k].abs().max()) for k in keys) > 0, part


@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "tp2_enc_tp2", "pp2", "pp2_decoupled", "cp2", "balanced",
                                    "moe_ep2", "moe_tp2_enc_tp2"])
def test_first_step_loss_and_gradients_match_dp2(layouts: dict, layout: str) -> None:
    ref = "moe_dp2" if layout.startswith("moe") else "dp2"
    assert _rel(layouts["loss"][layout], layouts["loss"][ref]) <= 1e-5
    assert layouts["grad_keys_equal"][layout]
    assert layouts["grad_err"][layout] <= 1e-5, layouts["grad_err"]


def test_dp2_equals_dp1(layouts: dict) -> None:
    """The DP=2 step against one process holding the whole global batch (4 micro-batches), same weights."""
    sys.path.insert(0, str(WORKER.parent))
    from vlm_layouts import LAYOUTS, one_step

    from loong.core.accelerators import select_accelerator
    from loong.core.engines.megatron.layout import shutdown_distributed

    acc = select_accelerator("cpu")
    ref = layouts["dp2_step"]
    try:
        with acc.activate(engine="megatron"), contextlib.redirect_stderr(io.StringIO()):
            got = one_step(layouts["root"], LAYOUTS["dp2"], acc, weights=ref["weights"])
    finally:
        shutdown_distributed()
    assert got["nmb"] == 2 * layouts["nmb"]["dp2"]
    assert _rel(got["loss"], ref["loss"]) <= 1e-5
    assert sorted(got["grads"]) == sorted(ref["grads"])
    assert _grad_err(got["grads"], ref["grads"]) <= 1e-5


@pytest.mark.parametrize("layout", ["tp2_enc_tp2", "pp2", "pp2_decoupled", "cp2"])
def test_ten_steps_track_dp2(layouts: dict, layout: str) -> None:
    ref, got = layouts["train"]["dp2"], layouts["train"][layout]
    assert len(ref) == len(got) == 10
    assert max(_rel(a, b) for a, b in zip(got, ref, strict=True)) <= 1e-5
    assert ref[-1] < ref[0] - 0.5  # it trains


def test_a_tp2_checkpoint_resumes_at_tp1_and_back_with_the_same_next_loss(layouts: dict) -> None:
    """A TP=2 run's checkpoint (``encoder.parallel.tp=2``: the foundation's and the encoder's shards saved as slices
    of the whole tensors): DP=2 (everything at TP=1) resumes its step-5 checkpoint with its next losses, and it
    resumes DP=2's with DP=2's: the next loss (the weights) and the one after (the optimiser state)."""
    for resumed, saved in (("dp2_resumed_from_enc_tp2", "tp2_enc_tp2"), ("enc_tp2_resumed_from_dp2", "dp2")):
        got, ref = layouts["train"][resumed], layouts["train"][saved]
        assert got[:5] == [float("-inf")] * 5 and len(got) == 7, resumed  # steps 1-5 came from the checkpoint
        assert max(_rel(a, b) for a, b in zip(got[5:], ref[5:7], strict=True)) <= 1e-5, resumed


def test_the_encoder_tp2_gradient_norm_is_the_tp1_one(layouts: dict) -> None:
    """Megatron's gradient norm (what ``train.clip_grad`` clips by) counts each encoder shard once and each
    replicated encoder weight once: every step's norm equals DP=2's (all at TP=1)."""
    ref, got = layouts["grad_norm"]["dp2"], layouts["grad_norm"]["tp2_enc_tp2"]
    assert len(ref) == len(got) == 10
    assert max(_rel(a, b) for a, b in zip(got, ref, strict=True)) <= 1e-5, (got, ref)


@pytest.mark.parametrize(("preset", "shards"), [("qwen2_5_vit_tiny", 32), ("qwen3_vit_tiny", 24),
                                                ("intern_vit_tiny", 24), ("siglip2_tiny", 24)])
def test_every_encoder_family_sharded_over_two_ranks_equals_itself_unsharded(layouts: dict, preset: str,
                                                                             shards: int) -> None:
    """Each block's qkv, proj and MLP weights sharded (Qwen2.5-VL's gated MLP: 8 tensors a block, the others 6, over
    4 blocks), the loss and every whole gradient of the unsharded encoder within 1e-5."""
    got = layouts["encoder_tp"][preset]
    assert got["sharded"] == shards and got["keys_equal"], got
    assert got["loss_err"] <= 1e-5 and got["grad_err"] <= 1e-5, got


def test_hf_export_and_load_at_encoder_tp2_see_the_whole_tensors(layouts: dict) -> None:
    """``train.save_hf`` from the sharded model writes the whole HF tensors (every encoder key, whole shapes, the
    weights bit for bit), and ``model.init_from_hf`` slices them back into the shards."""
    got = layouts["hf_enc_tp2"]
    assert got["encoder_keys"] > 0 and got["encoder_shapes_whole"] and got["loaded_keys_equal"], got
    assert got["export_err"] == 0.0 and got["init_err"] == 0.0, got


def test_a_decoupled_pp2_checkpoint_resumes_coupled_and_back(layouts: dict) -> None:
    """``encoder.decoupled=true`` saves the tower under ``encoder.*`` / ``projector.*`` once (stage 0's copy): the
    coupled PP=2 layout resumes it with the same next losses, and a coupled one resumes decoupled."""
    for resumed, saved in (("pp2_resumed_from_decoupled", "pp2_decoupled"), ("decoupled_resumed_from_pp2", "pp2")):
        got, ref = layouts["train"][resumed], layouts["train"][saved]
        assert got[:5] == [float("-inf")] * 5, resumed
        assert max(_rel(a, b) for a, b in zip(got[5:], ref[5:], strict=True)) <= 1e-5, resumed


@pytest.mark.parametrize("run", ["frozen_decoupled", "frozen_enc_tp2"])
def test_a_frozen_encoder_holds_no_optimiser_state_on_any_rank(layouts: dict, run: str) -> None:
    """``model.freeze=[encoder]`` with the decoupled tower (a replica on each stage) and with the encoder sharded
    over TP=2 (a shard on each rank): no encoder parameter is in the optimiser, holds state or changes."""
    ranks = layouts[run]["ranks"]
    assert len(ranks) == 2 and all("encoder" in r and "projector" in r for r in ranks)  # on each rank: a replica or a shard
    for r in ranks:
        assert r["encoder"] == {"optimizer": False, "state": False, "changed": False}, r
        assert r["projector"] == {"optimizer": True, "state": True, "changed": True}, r


def test_balancing_moves_samples_and_lowers_the_predicted_imbalance(layouts: dict) -> None:
    plain, balanced = layouts["samples"]["dp2"], layouts["samples"]["balanced"]
    # every sample of the global batch exactly once, on some rank, but not where it was without balancing
    assert sorted(sum(plain, [])) == sorted(sum(balanced, []))
    assert len(set(sum(balanced, []))) == len(sum(balanced, []))
    assert plain != balanced
    m = layouts["balance_metrics"]
    assert m["balance_after"] < m["balance_before"], m
    assert m["balance_after"] <= 1.05, m


def test_balance_metrics_are_logged_every_step_and_the_cost_fit_once(layouts: dict) -> None:
    records = layouts["balanced_fit_records"]
    train = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all("balance_before" in r and "balance_after" in r for r in train)
    assert train[0]["balance_after"] < train[0]["balance_before"]  # the FLOPs model, before the fit
    fitted = [r for r in records if "balance_cost_enc_a" in r]
    assert len(fitted) == 1  # after fit_steps=2 observations (the first step is not timed)
    assert all(fitted[0][f"balance_cost_{k}"] >= 0 for k in ("a", "b", "c", "enc_a", "enc_b"))
    losses = layouts["train"]["balanced_fit"]
    assert losses[-1] < losses[0]


def test_decoupled_with_virtual_pipeline_stages_is_refused() -> None:
    from loong.core.config import compose_config
    from loong.core.errors import LoongError
    from loong.vlm.schema import VLMRunConfig
    from loong.vlm.task import check_vlm_config

    cfg, _ = compose_config("loong.vlm.configs", "train",
                            ["parallel.pp=2", "parallel.vpp=2", "encoder.decoupled=true"], VLMRunConfig)
    with pytest.raises(LoongError, match=r"encoder.decoupled=true with parallel.vpp=2 is not supported"):
        check_vlm_config(cfg)
    cfg.parallel.vpp = None
    check_vlm_config(cfg)  # pp=2 alone is accepted


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.seq_length=126"], r"parallel.cp=2: train.seq_length=126 must divide by 2 \* cp = 4"),
    (["parallel.pp=2", "encoder.decoupled=true"], r"encoder.decoupled=true with parallel.cp=2 is not supported"),
    (["data.balance.enabled=true"], r"data.balance.enabled=true with parallel.cp=2 is not supported"),
])
def test_context_parallel_combinations_it_cannot_run_are_refused(overrides: list[str], message: str) -> None:
    from loong.core.config import compose_config
    from loong.core.errors import LoongError
    from loong.vlm.schema import VLMRunConfig
    from loong.vlm.task import check_vlm_config

    cfg, _ = compose_config("loong.vlm.configs", "train", ["parallel.cp=2", *overrides], VLMRunConfig)
    with pytest.raises(LoongError, match=message):
        check_vlm_config(cfg)
    cfg, _ = compose_config("loong.vlm.configs", "train", ["parallel.cp=2"], VLMRunConfig)
    check_vlm_config(cfg)  # cp=2 alone is accepted
