"""loong-llm's plugin: registered lazily (no megatron-core, no torch at `--help`), idempotent, its names suggested."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loong.core.errors import LoongError
from loong.core.registry import CONFIG_DIRS, TASKS, _Lazy, load_plugins


def test_load_plugins_registers_llm_lazily_and_stays_light() -> None:
    """Loading plugins (what `--help` and preset listing do) must not import megatron-core or torch."""
    code = textwrap.dedent("""
        import json, sys
        import loong.core.registry as r
        plugins = r.load_plugins()
        entry = r.TASKS._entries.get("llm.pretrain")
        print(json.dumps({
            "plugins": plugins,
            "task_is_lazy": isinstance(entry, r._Lazy),
            "task_target": getattr(entry, "target", None),
            "config_dir": r.CONFIG_DIRS._entries.get("llm"),
            "tasks": r.TASKS.names(),
            "megatron": any(m == "megatron" or m.startswith("megatron.") for m in sys.modules),
            "torch": "torch" in sys.modules,
            "pretrain_module": "loong.llm.pretrain" in sys.modules,
        }))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "llm" in got["plugins"]
    assert got["task_is_lazy"] is True
    assert got["task_target"] == "loong.llm.pretrain:PretrainTask"
    assert got["config_dir"] == "pkg://loong.llm.configs"
    assert "llm.pretrain" in got["tasks"]
    assert got["megatron"] is False
    assert got["torch"] is False
    assert got["pretrain_module"] is False


def test_load_plugins_is_idempotent_and_the_lazy_task_target_exists() -> None:
    first = load_plugins()
    assert load_plugins() == first
    assert "llm" in first
    assert CONFIG_DIRS.get("llm") == "pkg://loong.llm.configs"
    # The lazy target names a real class; checked from the source, so megatron-core (~9 s) stays unimported.
    target = TASKS._entries["llm.pretrain"]
    module, _, attr = (
        target.target if isinstance(target, _Lazy) else f"{target.__module__}:{target.__qualname__}"
    ).partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    tree = ast.parse(Path(spec.origin).read_text())
    assert attr in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}, f"{module} has no class {attr}"


def test_unknown_task_suggests_the_installed_one() -> None:
    with pytest.raises(LoongError, match=r"unknown task 'llm.pretrian'; did you mean 'llm.pretrain'\?"):
        TASKS.get("llm.pretrian")
