"""Finding and checking Kunlun's runtime, against the SIMULATED runtime (no Kunlun device was used)."""

from __future__ import annotations

import sys
from collections import OrderedDict
from types import ModuleType

import pytest

from loong.core.errors import LoongError
from loong.xpu.runtime import (
    DISABLE_VAR,
    RUNTIME_MODULE,
    ProcessHost,
    load_runtime,
    process_group_name,
    runtime_version,
    unavailable_reason,
)


def test_missing_runtime_names_what_to_install(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost(installed=False)
    reason = unavailable_reason(host)
    assert reason is not None
    assert "no module torch_xmlir" in reason and "XPyTorch" in reason and "Kunlunxin SDK" in reason
    with pytest.raises(LoongError, match="xpu: Kunlun's PyTorch runtime is not installed"):
        load_runtime(host)
    assert host.imported == []


def test_disable_xpytorch_makes_it_unavailable_without_importing(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost(environ={DISABLE_VAR: "1"})
    assert "DISABLE_XPYTORCH=1" in unavailable_reason(host)
    with pytest.raises(LoongError, match="DISABLE_XPYTORCH=1"):
        load_runtime(host)
    assert host.imported == []
    assert unavailable_reason(sim.SimulatedKunlunHost(environ={DISABLE_VAR: "0"})) is None


def test_load_maps_cards_backend_and_version(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost(devices=8)
    assert unavailable_reason(host) is None
    runtime = load_runtime(host)
    assert host.imported == [RUNTIME_MODULE]
    assert runtime.device_count == 8
    assert runtime.device_module is host.cuda  # the cards are driven through torch.cuda, not torch.xpu
    assert runtime.process_group == "kccl"
    assert runtime.version == "XPyTorch 3.2.0, XRE 5.0.21, BKCL 1.2.11"
    assert runtime.origin == sim.SIMULATED_ORIGIN


@pytest.mark.parametrize(("value", "group"), [
    (None, "kccl"), ("1", "kccl"), ("true", "kccl"), (" ON ", "kccl"), ("0", "bccl"), ("false", "bccl"),
    ("no", "bccl"),
])
def test_process_group_follows_xmlir_enable_new_pg(value: str | None, group: str) -> None:
    environ = {} if value is None else {"XMLIR_ENABLE_NEW_PG": value}
    assert process_group_name(environ) == group


def test_old_process_group_must_be_registered_when_chosen(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost(environ={"XMLIR_ENABLE_NEW_PG": "0"}, backends=("gloo", "nccl", "kccl"))
    with pytest.raises(LoongError, match="did not register its BKCL process group 'bccl'"):
        load_runtime(host)
    assert load_runtime(sim.SimulatedKunlunHost(environ={"XMLIR_ENABLE_NEW_PG": "0"})).process_group == "bccl"


def test_no_visible_card_is_a_clear_error(sim: ModuleType) -> None:
    with pytest.raises(LoongError) as err:
        load_runtime(sim.SimulatedKunlunHost(devices=0))
    msg = str(err.value)
    assert "torch.cuda sees no Kunlun device" in msg and "XPU_VISIBLE_DEVICES" in msg and "/dev/xpuctrl" in msg


def test_missing_bkcl_group_refuses_to_run_collectives_elsewhere(sim: ModuleType) -> None:
    with pytest.raises(LoongError, match="collectives would not reach BKCL"):
        load_runtime(sim.SimulatedKunlunHost(backends=("gloo", "nccl")))


def test_a_failing_runtime_import_is_reported_with_its_cause(sim: ModuleType) -> None:
    host = sim.SimulatedKunlunHost(import_error=OSError("libxpurt.so.1: cannot open shared object file"))
    with pytest.raises(LoongError, match=r"importing torch_xmlir failed \(OSError: libxpurt.so.1"):
        load_runtime(host)


@pytest.mark.parametrize(("version", "text"), [
    ("2.1.0", "2.1.0"),
    (None, "unknown"),
    (OrderedDict(), "unknown"),
    (OrderedDict((f"c{i}", str(i)) for i in range(8)), "c0 0, c1 1, c2 2, c3 3, c4 4, c5 5, ..."),
])
def test_runtime_version_is_one_line(version: object, text: str) -> None:
    module = ModuleType("torch_xmlir")
    if version is not None:
        module.__version__ = version  # type: ignore[attr-defined]
    assert runtime_version(module) == text


def test_process_host_looks_without_importing() -> None:
    host = ProcessHost()
    sys.modules.pop("this", None)  # `import this` prints the Zen of Python; find_spec must not run it
    assert host.find_module("this") is not None
    assert "this" not in sys.modules
    assert host.find_module("loong_no_such_module_anywhere") is None
    assert host.find_module("loong_no_such_package.sub") is None  # a missing parent is "absent", not an error
    assert "nccl" in host.registered_backends() and "gloo" in host.registered_backends()
