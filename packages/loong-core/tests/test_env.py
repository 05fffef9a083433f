"""``loong env``: what it reports, that it never fails, and that every CLI built with make_cli has it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

import loong.core
from loong.core import env
from loong.core.accelerators import Accelerator
from loong.core.accelerators.cpu import CPUAccelerator
from loong.core.cli import Command, make_cli


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_versions_come_from_package_metadata() -> None:
    info = env.collect(environ={})
    libs = info["libraries"]
    assert {"torch", "megatron-core", "transformer-engine", "flash-attn", "triton"} <= set(libs)
    assert libs["torch"] == importlib.metadata.version("torch")
    assert libs["megatron-core"] == importlib.metadata.version("megatron-core")
    assert libs["flash-attn"] == _installed("flash-attn")  # None where it is not installed
    assert info["loong"]["loong-core"].split()[0] == loong.core.__version__
    assert all(name.startswith("loong-") for name in info["loong"])


def test_missing_libraries_read_not_installed() -> None:
    info = env.collect(environ={})
    info["libraries"]["flash-attn"] = None
    assert "  flash-attn          not installed" in env.format_text(info).splitlines()


def test_engines_and_what_each_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    info = env.collect(environ={})
    assert info["engines"]["megatron"] == f"megatron-core {importlib.metadata.version('megatron-core')}"
    assert info["engines"]["fsdp"].endswith(importlib.metadata.version("torch"))
    real = env._version
    monkeypatch.setattr(env, "_version", lambda names: None if names == ("megatron-core",) else real(names))
    text = env.format_text(env.collect(environ={}))
    assert "  megatron  not installed: megatron-core (pip install 'loong-core[megatron]')" in text.splitlines()


def test_accelerators_availability_capabilities_and_choice() -> None:
    info = env.collect(environ={})
    rows = {r["name"]: r for r in info["accelerators"]}
    assert rows["cpu"]["available"] and rows["cpu"]["capabilities"] == ["sdpa"]
    assert rows["cpu"]["reason"] is None and rows["cpu"]["backend"] == "gloo"
    for row in rows.values():
        assert row["available"] == (row["reason"] is None)
        assert row["available"] or row["capabilities"] is None  # asked only where the hardware is
    priorities = [r["priority"] for r in info["accelerators"]]
    assert priorities == sorted(priorities, reverse=True)
    assert "LOONG_ACCELERATOR is not set" in info["selected"]["why"]
    assert env.collect(environ={"LOONG_ACCELERATOR": "cpu"})["selected"] == {
        "name": "cpu", "why": "LOONG_ACCELERATOR=cpu"}


def test_a_bad_choice_is_reported_not_raised() -> None:
    info = env.collect(environ={"LOONG_ACCELERATOR": "cpux"})
    assert info["selected"]["name"] is None
    assert "unknown accelerator 'cpux'; did you mean 'cpu'?" in info["selected"]["error"]
    text = env.format_text(info)
    assert "Selected: none" in text and "did you mean 'cpu'" in text


def test_a_broken_plugin_is_reported_not_raised() -> None:
    def boom(cls: type) -> str:
        raise RuntimeError("driver exploded")

    broken = type("Broken", (Accelerator,), {"name": "broken", "priority": 7,
                                              "is_available": classmethod(lambda cls: True),
                                              "unavailable_reason": classmethod(boom),
                                              "runtime_info": classmethod(boom)})
    rows, selected = env._accelerators({"cpu": CPUAccelerator, "broken": broken},
                                       {"ghost": "ghost.mod:Acc: ImportError: no ghost"}, environ={})
    by_name = {r["name"]: r for r in rows}
    assert by_name["broken"]["available"] is False
    assert by_name["broken"]["reason"] == "error: RuntimeError: driver exploded"
    assert by_name["broken"]["runtime"] == "error: RuntimeError: driver exploded"
    assert by_name["ghost"]["reason"] == "plugin failed to load: ghost.mod:Acc: ImportError: no ghost"
    assert selected["name"] == "broken"  # its is_available() said yes; the rule is the run's rule
    info = {"python": {"version": "3", "executable": "py", "platform": "p"}, "loong": {}, "libraries": {},
            "accelerator_group": "g", "accelerators": rows, "selected": selected, "environment": {}}
    text = env.format_text(info)
    assert "plugin failed to load: ghost.mod:Acc" in text and "error: RuntimeError" in text


def test_distributed_environment() -> None:
    environ = {"RANK": "3", "WORLD_SIZE": "8", "NCCL_DEBUG": "INFO", "TORCHELASTIC_RUN_ID": "r1",
               "LOONG_ACCELERATOR": "cpu", "GLOO_SOCKET_IFNAME": "eth0", "HOME": "/root", "SECRET_TOKEN": "x"}
    out = env.collect(environ=environ)["environment"]
    assert out["RANK"] == "3" and out["WORLD_SIZE"] == "8"
    assert out["LOCAL_RANK"] is None and out["MASTER_ADDR"] is None and out["MASTER_PORT"] is None
    assert out["NCCL_DEBUG"] == "INFO"  # from the cuda accelerator's env_vars
    assert out["GLOO_SOCKET_IFNAME"] == "eth0"  # from the cpu accelerator's
    assert out["TORCHELASTIC_RUN_ID"] == "r1" and out["LOONG_ACCELERATOR"] == "cpu"
    assert "HOME" not in out and "SECRET_TOKEN" not in out
    text = env.main(environ=environ)
    assert "  LOCAL_RANK           not set" in text.splitlines()


def test_json_round_trips() -> None:
    data = json.loads(env.main(as_json=True, environ={"RANK": "0"}))
    assert data["environment"]["RANK"] == "0"
    assert data["accelerator_group"] == "loong.accelerators"


def test_every_make_cli_has_env(capsys: pytest.CaptureFixture[str]) -> None:
    main = make_cli("dummy", "d", "dummy.cli", {"go": Command("go", lambda p: None, lambda a: 0)})
    assert main(["env", "--json"]) == 0
    assert "libraries" in json.loads(capsys.readouterr().out)
    own = Command("mine", lambda p: None, lambda a: 9)
    assert make_cli("dummy", "d", "dummy.cli", {"env": own})(["env"]) == 9  # a modality's own env wins


def test_loong_env_is_fast_to_start() -> None:
    """The whole command, in a fresh interpreter, without importing megatron-core or Transformer Engine."""
    code = ("import sys\nfrom loong.core.cli import main\ncode = main(['env'])\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformer_engine'))\n"
            "print('HEAVY', heavy, code)\n")
    envv = {k: v for k, v in os.environ.items() if k != "LOONG_ACCELERATOR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=envv)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "HEAVY [] 0"
    assert "Loong environment" in out.stdout and "Distributed environment" in out.stdout
