"""The xpu accelerator: selection on this machine (no Kunlun runtime here) and its mapping, defaults and
capabilities against the SIMULATED runtime. No real Kunlun device or runtime was used."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from types import ModuleType

import pytest
import torch

from loong.core.accelerators import available_accelerators, choose_accelerator, select_accelerator
from loong.core.accelerators.capabilities import CAPABILITIES
from loong.core.accelerators.cpu import CPUAccelerator
from loong.core.accelerators.cuda import CUDAAccelerator
from loong.core.errors import LoongError
from loong.xpu.accelerator import EXTRA_CAPABILITIES_VAR, XPUAccelerator
from loong.xpu.env_defaults import DEFAULTS
from loong.xpu.megatron import CONFIG_OVERRIDES
from loong.xpu.runtime import unavailable_reason

no_runtime_here = pytest.mark.skipif(importlib.util.find_spec("torch_xmlir") is not None,
                                     reason="Kunlun's runtime is installed on this machine")


# --- discovery and selection on this machine ------------------------------------------------------


def test_installing_loong_xpu_registers_xpu() -> None:
    assert available_accelerators()["xpu"] is XPUAccelerator


@no_runtime_here
@pytest.mark.parametrize("how", ["env", "code"])
def test_selecting_xpu_without_the_runtime_names_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                                 how: str) -> None:
    monkeypatch.setenv("LOONG_ACCELERATOR", "xpu")
    before = dict(os.environ)
    with pytest.raises(LoongError) as err:
        select_accelerator("xpu" if how == "code" else None)
    msg = str(err.value)
    assert msg.startswith("accelerator 'xpu' is installed but not available on this machine: ")
    assert "no module torch_xmlir" in msg and "install Kunlunxin's XPyTorch" in msg
    assert dict(os.environ) == before  # nothing was set on the way to the error


def test_a_misspelt_name_suggests_xpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOONG_ACCELERATOR", "xup")
    with pytest.raises(LoongError, match="unknown accelerator 'xup'; did you mean 'xpu'"):
        select_accelerator()


@no_runtime_here
def test_without_the_runtime_the_automatic_choice_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOONG_ACCELERATOR", raising=False)
    installed = available_accelerators()
    assert not XPUAccelerator.is_available()
    without_xpu = {k: v for k, v in installed.items() if k != "xpu"}
    assert type(select_accelerator()) is choose_accelerator(without_xpu)[0]


def test_with_the_runtime_the_automatic_choice_is_xpu(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost()

    class SimulatedXPU(XPUAccelerator):
        @classmethod
        def unavailable_reason(cls) -> str | None:
            return unavailable_reason(host)

        @classmethod
        def is_available(cls) -> bool:
            return cls.unavailable_reason() is None

    class CudaSeenThroughTheRuntime(CUDAAccelerator):  # torch_xmlir makes torch.cuda report the cards
        @classmethod
        def is_available(cls) -> bool:
            return True

    installed = {"cpu": CPUAccelerator, "cuda": CudaSeenThroughTheRuntime, "xpu": SimulatedXPU}
    cls, why = choose_accelerator(installed, environ={})
    assert cls is SimulatedXPU
    assert "xpu=150, cuda=100, cpu=0" in why
    assert choose_accelerator(installed, environ={"LOONG_ACCELERATOR": "cpu"})[0] is CPUAccelerator


# --- activation and the device mapping, on the simulated runtime ----------------------------------


def test_device_methods_drive_torch_cuda_of_the_runtime(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost(devices=4)
    acc = XPUAccelerator(host)
    with acc.activate():
        assert acc.device(3) == torch.device("cuda", 3)
        acc.set_device(3)
        acc.manual_seed(11)
        host_draw = torch.rand(3)
        acc.synchronize()
        host.cuda.peak_bytes = 12345
        assert acc.max_memory_allocated() == 12345
        acc.reset_peak_memory()
        assert acc.max_memory_allocated() == 0
        with pytest.raises(LoongError, match="local rank 4 but 4 Kunlun device"):
            acc.set_device(4)
    assert host.cuda.calls == [("set_device", 3), ("manual_seed_all", 11), ("synchronize",),
                               ("reset_peak_memory_stats",)]
    torch.manual_seed(11)
    assert torch.equal(host_draw, torch.rand(3))  # the host generator was seeded too
    assert (acc.backend, acc.device_type, acc.default_dtype()) == ("nccl", "cuda", torch.bfloat16)
    assert acc.peak_flops(torch.bfloat16) is None


def test_device_methods_refuse_outside_activation(sim: ModuleType) -> None:
    acc = XPUAccelerator(sim.SimulatedKunlunHost())
    for call in (lambda: acc.set_device(0), acc.synchronize, acc.max_memory_allocated):
        with pytest.raises(RuntimeError, match="only inside `with accelerator.activate"):
            call()
    with acc.activate():
        with acc.activate():  # nested activation (e.g. a conversion inside a run) keeps the outer one
            acc.synchronize()
        acc.synchronize()
    with pytest.raises(RuntimeError):
        acc.synchronize()


def test_defaults_are_set_only_while_active_and_user_values_win(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost(environ={"BKCL_TIMEOUT": "60", "UNRELATED": "x"})
    before = dict(host.environ)
    acc = XPUAccelerator(host)
    assert host.environ == before  # constructing it sets nothing
    with acc.activate():
        assert host.environ["BKCL_TIMEOUT"] == "60"
        for d in DEFAULTS:
            if d.name != "BKCL_TIMEOUT":
                assert host.environ[d.name] == d.value
    assert host.environ == before


def test_a_failed_activation_leaves_nothing_behind(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost(devices=0, environ={"KEEP": "1"})
    acc = XPUAccelerator(host)
    with pytest.raises(LoongError, match="sees no Kunlun device"):
        with acc.activate():
            pytest.fail("activation must not succeed without a card")
    assert host.environ == {"KEEP": "1"}
    with pytest.raises(RuntimeError):
        acc.synchronize()


def test_capabilities_send_every_fused_path_to_its_reference(sim: ModuleType) -> None:
    acc = XPUAccelerator(sim.SimulatedKunlunHost())
    assert acc.capabilities() == {"sdpa"}
    assert not {"triton", "fp8", "transformer_engine", "flash_attn"} & acc.capabilities()


def test_extra_capabilities_are_opt_in_and_checked(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost(environ={EXTRA_CAPABILITIES_VAR: "transformer_engine, flash_attn"})
    assert XPUAccelerator(host).capabilities() == {"sdpa", "transformer_engine", "flash_attn"}
    host.environ[EXTRA_CAPABILITIES_VAR] = "flash-attn"
    with pytest.raises(LoongError, match="unknown capability 'flash-attn'; did you mean 'flash_attn'"):
        XPUAccelerator(host).capabilities()
    assert set(CAPABILITIES) >= XPUAccelerator(sim.SimulatedKunlunHost()).capabilities()


def test_megatron_overrides_are_real_transformer_config_fields() -> None:
    # megatron-core comes with loong-llm, not with this plugin: the workspace runs this check, the plugin's wheel
    # tested alone (scripts/release.py) has no megatron overrides to apply and skips it
    pytest.importorskip("megatron.core", reason="megatron-core is loong-llm's dependency, not loong-xpu's")
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    overrides = XPUAccelerator().megatron_config_overrides()
    assert overrides == {o.field: False for o in CONFIG_OVERRIDES}
    assert set(overrides) <= fields, set(overrides) - fields  # a megatron-core rename must fail here


def test_defaults_only_touch_what_is_read_after_start_up() -> None:
    names = [d.name for d in DEFAULTS]
    assert len(names) == len(set(names))
    # BKCL reads its settings when a communicator is created, after activation; torch_xmlir's own
    # settings are read when it is imported, which a plugin is too late for.
    assert all(n.startswith("BKCL_") for n in names)
    assert all(isinstance(d.value, str) and d.why for d in DEFAULTS)
