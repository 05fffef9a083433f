"""``model.freeze`` and ``model.lr_mult`` on the tiny VLM, one process: frozen components take no gradient, hold
no optimiser state and keep their weights bit for bit while the rest trains; a component's learning-rate
multiplier scales its learning rate on every step and its first Adam update exactly.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from vlm_layouts import build  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.config import compose_config  # noqa: E402
from loong.core.engines.megatron.engine import MegatronEngine  # noqa: E402
from loong.core.engines.megatron.layout import shutdown_distributed  # noqa: E402
from loong.core.engines.megatron.state import unwrap  # noqa: E402
from loong.core.errors import LoongError  # noqa: E402
from loong.vlm.schema import COMPONENTS, VLMRunConfig  # noqa: E402

LR = 1e-3


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vlm_freeze")


def _component(name: str) -> str:
    return name.split(".", 1)[0]


def _run(root: Path, overrides: list[str], steps: int) -> dict:
    """Build the tiny VLM with ``overrides``, train ``steps`` steps; weights before and after, the engine."""
    acc = select_accelerator("cpu")
    try:
        with acc.activate(engine="megatron"), contextlib.redirect_stderr(io.StringIO()):
            cfg, layout, task = build(root, overrides, acc, steps=steps)
            assert cfg.train.lr == LR
            engine = MegatronEngine(task, cfg, acc, layout)
            model = unwrap(engine.model_chunks[0])
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            lrs = []
            for step in range(steps):
                metrics = engine.train_step(step)
                assert not metrics.skipped
                lrs.append(metrics.lr)
            params = dict(model.named_parameters())
            groups = engine.optimizer.param_groups
            group_lr = {n: next(g["lr"] for g in groups if any(q is p for q in g["params"]))
                        for n, p in params.items() if p.requires_grad}
            in_optimizer = {id(q) for g in groups for q in g["params"]}
            with_state = {id(q) for opt in engine._torch_adams() for q in opt.state}
            return {"before": before, "after": {n: p.detach().clone() for n, p in params.items()},
                    "requires_grad": {n: p.requires_grad for n, p in params.items()},
                    "main_grad": {n: getattr(p, "main_grad", None) is not None for n, p in params.items()},
                    "in_optimizer": {n: id(p) in in_optimizer for n, p in params.items()},
                    "with_state": {n: id(p) in with_state for n, p in params.items()},
                    "group_lr": group_lr, "logged_lr": lrs}
    finally:
        shutdown_distributed()


@pytest.mark.parametrize("frozen", [["encoder"], ["encoder", "foundation"]], ids=["encoder", "encoder+foundation"])
def test_frozen_components_take_no_gradient_no_state_and_keep_their_weights(root: Path, frozen: list[str]) -> None:
    r = _run(root, [f"model.freeze=[{','.join(frozen)}]"], steps=2)
    names = list(r["before"])
    assert {_component(n) for n in names} == set(COMPONENTS)
    for n in names:
        if _component(n) in frozen:
            assert not r["requires_grad"][n] and not r["main_grad"][n], n
            assert not r["in_optimizer"][n] and not r["with_state"][n], n
            assert torch.equal(r["after"][n], r["before"][n]), n
        else:
            assert r["in_optimizer"][n] and r["with_state"][n], n
    for part in set(COMPONENTS) - set(frozen):  # the rest trains: every tensor of it moved
        moved = [n for n in names if _component(n) == part and not torch.equal(r["after"][n], r["before"][n])]
        assert moved == [n for n in names if _component(n) == part], part


def test_lr_mult_scales_the_learning_rate_and_the_first_update(root: Path) -> None:
    base = _run(root, [], steps=1)
    mult = {"encoder": 0.1, "projector": 2.0}
    scaled = _run(root, ["model.lr_mult={encoder:0.1,projector:2.0}"], steps=1)
    assert scaled["logged_lr"] == base["logged_lr"] == [LR]  # the schedule's own learning rate is logged
    for n, lr in scaled["group_lr"].items():
        assert lr == pytest.approx(LR * mult.get(_component(n), 1.0), rel=1e-12), n
    # the same gradients (same weights, same batch), so Adam's first update is the same direction times the LR
    for n in base["before"]:
        assert torch.equal(base["before"][n], scaled["before"][n]), n
        want = (base["after"][n] - base["before"][n]) * mult.get(_component(n), 1.0)
        got = scaled["after"][n] - scaled["before"][n]
        assert want.abs().max() > 0, n
        assert float((got - want).abs().max() / want.abs().max()) <= 2e-3, n


def test_bad_freeze_and_lr_mult_are_refused() -> None:
    def compose(*overrides: str) -> None:
        compose_config("loong.vlm.configs", "train", list(overrides), VLMRunConfig)

    with pytest.raises(LoongError, match=r"model\.freeze: \['vision'\] are not components"):
        compose("model.freeze=[vision]")
    with pytest.raises(LoongError, match="freezes every component"):
        compose("model.freeze=[encoder,projector,foundation]")
    with pytest.raises(LoongError, match=r"unknown config key 'model\.lr_mult\.vision'"):
        compose("model.lr_mult.vision=0.1")
    with pytest.raises(LoongError, match=r"model\.lr_mult\.encoder=0\.0: must be > 0"):
        compose("model.lr_mult.encoder=0")
