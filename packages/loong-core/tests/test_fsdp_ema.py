"""``train.ema_decay`` / ``train.export_ema``: the keys' checks, the megatron engine's refusal, and a resume that
turns the EMA on over a checkpoint without one (the averages start at its weights). The moving average itself
(against the hand-computed recursion, sharded and DDP against one process) is in ``test_fsdp_engine.py``, its
bit-exact kill-and-resume in ``test_fsdp_fault.py``, its export in loong-diffusion's ``test_convert.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from loong.core.checkpoint.inspect import checkpoint_tensors
from loong.core.config.schema import RunConfig, TrainConfig, from_dict
from loong.core.errors import LoongError

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.parametrize("train,message", [
    ({"ema_decay": 1.0}, r"train.ema_decay=1.0: must be in \[0, 1\) \(0: off; e.g. 0.999\)"),
    ({"ema_decay": -0.1}, r"train.ema_decay"),
    ({"export_ema": True}, r"train.export_ema=true exports the EMA.*train.ema_decay=0"),
])  # fmt: skip
def test_bad_ema_keys_name_the_key(train: dict, message: str) -> None:
    with pytest.raises(LoongError, match=message):
        from_dict(RunConfig, {"train": train})
    assert from_dict(RunConfig, {"train": {"ema_decay": 0.999, "export_ema": True}}).train.ema_decay == 0.999
    assert TrainConfig().ema_decay == 0.0 and not TrainConfig().export_ema  # off by default


@pytest.mark.parametrize("key,value", [("ema_decay", 0.99), ("export_ema", True)])
def test_the_megatron_engine_refuses_the_ema(key: str, value: object) -> None:
    from loong.core.engines.megatron.engine import MegatronEngine

    cfg = RunConfig()
    setattr(cfg.train, key, value)
    with pytest.raises(LoongError, match=rf"train.{key}={value}: the EMA of the weights is an fsdp engine option"):
        MegatronEngine.check_config(cfg)


def test_resuming_without_averages_starts_them_at_the_checkpoints_weights(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    sys.path.insert(0, str(WORKERS))
    from toy_tasks import toy_config

    from loong.core.run import run

    said: list[str] = []
    common = {"output_dir": str(tmp_path), "run_name": "r"}
    run(toy_config(task="toy.dit", **common, train={"steps": 2}), echo=said.append)
    capsys.readouterr()
    before = checkpoint_tensors(tmp_path / "r" / "checkpoints" / "step_00000002")
    assert not any(k.startswith("ema.") for k in before)
    run(toy_config(task="toy.dit", **common, train={"steps": 3, "ema_decay": 0.5}), echo=said.append)
    assert any("resumed from" in m and "at step 2" in m for m in said)
    assert "step_00000002 holds no moving averages of the weights; they start at its weights" in capsys.readouterr().out
    after = checkpoint_tensors(tmp_path / "r" / "checkpoints" / "step_00000003")
    names = [k.removeprefix("model.") for k in after if k.startswith("model.")]
    assert sorted(k.removeprefix("ema.") for k in after if k.startswith("ema.")) == sorted(names)
    for name in names:  # one step from the step-2 weights: the mean of the step-2 and the step-3 weights
        want = 0.5 * before[f"model.{name}"] + 0.5 * after[f"model.{name}"]
        torch.testing.assert_close(after[f"ema.{name}"], want, rtol=1e-6, atol=1e-7)
