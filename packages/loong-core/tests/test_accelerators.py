"""The contract every registered accelerator passes, and the selection rule.

Every installed ``loong.accelerators`` entry point is checked: the class-level part everywhere, the
device part wherever the accelerator is available (cpu always; the others carry ``gpu`` and skip, with
the accelerator's own reason, on a machine without their hardware).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from loong.core.accelerators import (
    ENV_VAR,
    Accelerator,
    available_accelerators,
    choose_accelerator,
    load_accelerators,
)
from loong.core.accelerators.capabilities import CAPABILITIES, check_capabilities
from loong.core.errors import LoongError

INSTALLED = available_accelerators()
NAMES = sorted(INSTALLED)
ON_DEVICE = [pytest.param(n, marks=() if n == "cpu" else pytest.mark.gpu) for n in NAMES]


def test_the_core_ships_cpu_and_cuda() -> None:
    assert {"cpu", "cuda"} <= set(INSTALLED)
    assert not load_accelerators()[1]  # no installed plugin fails to load


# --- class level: holds everywhere, without the hardware ------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_class_contract(name: str) -> None:
    cls = INSTALLED[name]
    assert issubclass(cls, Accelerator)
    assert cls.name == name, "the entry-point name and the class's name must agree"
    assert name.isidentifier() and name == name.lower()
    assert isinstance(cls.device_type, str) and isinstance(cls.backend, str) and cls.backend
    assert isinstance(cls.priority, int)
    assert isinstance(cls.env_vars, tuple) and all(isinstance(v, str) and v for v in cls.env_vars)
    available = cls.is_available()
    assert isinstance(available, bool)
    reason = cls.unavailable_reason()
    assert (reason is None) == available, "unavailable_reason() is None exactly when available"
    assert reason is None or (isinstance(reason, str) and reason.strip())
    info = cls.runtime_info()
    assert isinstance(info, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in info.items())
    # train.optimizer_impl=auto takes this; a plain method (no device needed), answered without activation
    assert cls.adam_implementation(cls.__new__(cls)) in ("foreach", "fused")


def test_priorities_are_distinct() -> None:
    # Ties would make the automatic choice depend on entry-point order.
    priorities = [cls.priority for cls in INSTALLED.values()]
    assert len(priorities) == len(set(priorities))


def test_asking_every_plugin_changes_nothing_and_imports_no_megatron() -> None:
    """Loading the plugins and asking the questions selection and `loong env` ask is side-effect free."""
    code = (
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "from loong.core.accelerators import available_accelerators\n"
        "for cls in available_accelerators().values():\n"
        "    cls.is_available(); cls.unavailable_reason(); cls.runtime_info(); cls()\n"
        "print(json.dumps({'env_changed': sorted(set(os.environ.items()) ^ set(before.items())),\n"
        "                  'imported': sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "                                     ('megatron', 'transformer_engine', 'torch_xmlir'))}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"env_changed": [], "imported": []}


# --- device level: wherever the accelerator is available ------------------------------------------


def _usable(name: str) -> Accelerator:
    reason = INSTALLED[name].unavailable_reason()
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    return INSTALLED[name]()


@pytest.mark.parametrize("name", ON_DEVICE)
def test_device_contract(name: str) -> None:
    acc = _usable(name)
    with acc.activate():  # once first: modules imported on the way (megatron-core) may set variables
        pass
    env_before = dict(os.environ)
    with acc.activate():
        device = acc.device(0)
        assert isinstance(device, torch.device) and device.type == acc.device_type
        acc.set_device(0)
        acc.manual_seed(1234)
        a = torch.randn(16, device=device)
        acc.manual_seed(1234)
        b = torch.randn(16, device=device)
        acc.synchronize()
        assert torch.equal(a, b), "manual_seed must make device draws repeat"
        dtype = acc.default_dtype()
        assert isinstance(dtype, torch.dtype) and dtype.is_floating_point
        flops = acc.peak_flops(dtype)
        assert flops is None or flops > 0
        acc.reset_peak_memory()
        keep = torch.empty(1 << 20, dtype=torch.uint8, device=device)  # 1 MiB
        peak = acc.max_memory_allocated()
        assert peak is None or (isinstance(peak, int) and peak >= keep.numel())
        caps = acc.capabilities()
        assert isinstance(caps, set)
        check_capabilities(caps, f"{name}.capabilities()")  # only names models know how to ask for
        overrides = acc.megatron_config_overrides()
        assert isinstance(overrides, dict)
    assert dict(os.environ) == env_before, "activation must leave the environment as it found it"


@pytest.mark.parametrize("name", ON_DEVICE)
def test_megatron_overrides_name_real_fields(name: str) -> None:
    acc = _usable(name)
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(acc.megatron_config_overrides()) <= fields


# --- the selection rule, on stand-in classes -------------------------------------------------------


def _fake(name: str, priority: int, available: bool) -> type[Accelerator]:
    return type(f"Fake{name.title()}", (Accelerator,), {
        "name": name, "priority": priority,
        "is_available": classmethod(lambda cls: available),
        "unavailable_reason": classmethod(lambda cls: None if available else f"no {name} hardware here"),
    })


FAKES = {"low": _fake("low", 0, True), "mid": _fake("mid", 50, True), "top": _fake("top", 90, False)}


def test_automatic_choice_is_the_highest_available_priority() -> None:
    cls, why = choose_accelerator(FAKES, environ={})
    assert cls is FAKES["mid"]
    assert why == "highest priority among the available ones (mid=50, low=0); LOONG_ACCELERATOR is not set"


def test_the_env_var_picks_and_says_so() -> None:
    cls, why = choose_accelerator(FAKES, environ={ENV_VAR: "low"})
    assert (cls, why) == (FAKES["low"], "LOONG_ACCELERATOR=low")


def test_a_name_in_code_beats_the_env_var() -> None:
    cls, why = choose_accelerator(FAKES, "low", environ={ENV_VAR: "no-such"})
    assert cls is FAKES["low"] and why == "requested in code ('low')"


def test_an_empty_env_var_means_automatic() -> None:
    assert choose_accelerator(FAKES, environ={ENV_VAR: ""})[0] is FAKES["mid"]


def test_unknown_names_list_the_installed_and_the_closest() -> None:
    with pytest.raises(LoongError) as err:
        choose_accelerator(FAKES, environ={ENV_VAR: "mdi"})
    assert str(err.value) == "unknown accelerator 'mdi'; did you mean 'mid'? (installed: low, mid, top)"


def test_an_unavailable_choice_gives_its_reason() -> None:
    with pytest.raises(LoongError) as err:
        choose_accelerator(FAKES, environ={ENV_VAR: "top"})
    assert str(err.value) == "accelerator 'top' is installed but not available on this machine: no top hardware here"


def test_nothing_available_is_an_error() -> None:
    with pytest.raises(LoongError, match="no accelerator is available"):
        choose_accelerator({"top": FAKES["top"]}, environ={})


def test_the_real_automatic_choice_matches_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from loong.core.accelerators import select_accelerator

    monkeypatch.delenv(ENV_VAR, raising=False)
    best = max((c for c in INSTALLED.values() if c.is_available()), key=lambda c: c.priority)
    assert type(select_accelerator()) is best


def test_the_vocabulary_catches_typos() -> None:
    assert check_capabilities(["sdpa", "fp8"], "x") == {"sdpa", "fp8"}
    with pytest.raises(LoongError, match="x: unknown capability 'flash-attn'; did you mean 'flash_attn'"):
        check_capabilities(["flash-attn"], "x")
    assert all(desc for desc in CAPABILITIES.values())
