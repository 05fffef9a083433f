"""``loong env``: the versions, accelerators and distributed settings a bug report needs.

It must answer in a couple of seconds and never fail because something optional is missing or broken:
versions come from package metadata (``importlib.metadata``), so megatron-core, Transformer Engine and
flash-attn are never imported; each accelerator is asked only its cheap questions (``is_available``,
``unavailable_reason``, ``runtime_info``, and ``capabilities`` where available), each one guarded.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable, Mapping
from typing import Any

from loong.core.accelerators import GROUP, Accelerator, choose_accelerator, load_accelerators

#: library -> distribution names it is published under (the first installed one is reported).
LIBRARIES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core", "megatron_core"),
    "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
    "flash-attn": ("flash-attn", "flash_attn"),
    "triton": ("triton", "pytorch-triton"),
    "transformers": ("transformers",),
}

#: Always listed ("not set" when absent): what decides who a process is and where it rendezvous.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Listed when set, with every installed accelerator's own ``env_vars``.
OTHER_VARS = ("LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "TORCHELASTIC_*", "TORCH_DISTRIBUTED_DEBUG",
              "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODEID", "LOONG_*")


def _guard(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the error as text: one broken plugin must not hide the rest of the report."""
    try:
        return fn()
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}"


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def loong_packages() -> dict[str, str]:
    """Installed ``loong-*`` distributions -> version (editable installs say where they live)."""
    out: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if not name.startswith("loong-") or name in out:
            continue
        out[name] = dist.version
        direct = _guard(lambda d=dist: json.loads(d.read_text("direct_url.json") or "{}"))
        if isinstance(direct, dict) and direct.get("dir_info", {}).get("editable"):
            out[name] += f"  (editable: {direct.get('url', '').removeprefix('file://')})"
    return dict(sorted(out.items()))


def _accelerators(found: Mapping[str, type[Accelerator]], failed: Mapping[str, str],
                  environ: Mapping[str, str] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, cls in sorted(found.items(), key=lambda kv: -getattr(kv[1], "priority", 0)):
        reason = _guard(cls.unavailable_reason)
        row: dict[str, Any] = {
            "name": name, "class": f"{cls.__module__}.{cls.__qualname__}",
            "priority": getattr(cls, "priority", None), "device_type": getattr(cls, "device_type", None),
            "backend": getattr(cls, "backend", None), "available": reason is None,
            "reason": reason, "runtime": _guard(cls.runtime_info),
            "capabilities": None,
        }
        if reason is None:
            caps = _guard(lambda c=cls: sorted(c().capabilities()))
            row["capabilities"] = caps
        rows.append(row)
    rows += [{"name": name, "available": False, "reason": f"plugin failed to load: {why}"}
             for name, why in sorted(failed.items())]
    try:
        cls, why = choose_accelerator(found, environ=environ)
        selected: dict[str, Any] = {"name": cls.name, "why": why}
    except Exception as exc:  # LoongError for a bad LOONG_ACCELERATOR, or a plugin's own failure
        selected = {"name": None, "error": str(exc)}
    return rows, selected


def _env_patterns(found: Mapping[str, type[Accelerator]]) -> list[str]:
    patterns = list(OTHER_VARS)
    for cls in found.values():
        patterns += [p for p in getattr(cls, "env_vars", ()) if p not in patterns]
    return patterns


def environment_vars(patterns: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The launch variables (None when unset) and every set variable matching ``patterns``."""
    environ = os.environ if environ is None else environ
    out: dict[str, str | None] = {name: environ.get(name) for name in LAUNCH_VARS}
    for name in sorted(environ):
        if name not in out and any(fnmatch.fnmatchcase(name, p) for p in patterns):
            out[name] = environ[name]
    return out


#: engine -> (the library it needs, the distribution that provides it, how to install it)
ENGINE_LIBRARIES: dict[str, tuple[str, str, str]] = {
    "megatron": ("megatron-core", "megatron-core", "pip install 'loong-core[megatron]'"),
    "fsdp": ("torch.distributed.fsdp (FSDP2)", "torch", "part of torch"),
}


def engines() -> dict[str, str]:
    """Each engine and whether it can run here (its library installed), without importing either."""
    out = {}
    for name, (library, dist, how) in ENGINE_LIBRARIES.items():
        version = _version((dist,))
        out[name] = f"{library} {version}" if version else f"not installed: {library} ({how})"
    return out


def collect(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything ``loong env`` reports, as plain data (what ``--json`` prints)."""
    found, failed = load_accelerators()
    rows, selected = _accelerators(found, failed, environ)
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable,
                   "platform": platform.platform()},
        "loong": _guard(loong_packages),
        "libraries": {lib: _version(names) for lib, names in LIBRARIES.items()},
        "engines": engines(),
        "accelerator_group": GROUP,
        "accelerators": rows,
        "selected": selected,
        "environment": environment_vars(_env_patterns(found), environ),
    }


def _table(pairs: Mapping[str, Any], indent: str = "  ") -> list[str]:
    width = max((len(k) for k in pairs), default=0)
    return [f"{indent}{k:<{width}}  {v}" for k, v in pairs.items()]


def _accelerator_lines(row: dict[str, Any], width: int) -> list[str]:
    pad = " " * (width + 4)
    if "priority" not in row:  # a plugin that failed to load
        return [f"  {row['name']:<{width}}  {row['reason']}"]
    state = "available" if row["available"] else f"not available: {row['reason']}"
    lines = [f"  {row['name']:<{width}}  priority {row['priority']:<4} {state}"]
    caps = row["capabilities"]
    if row["available"]:
        lines.append(f"{pad}capabilities: {', '.join(caps) or '(none)'}" if isinstance(caps, list)
                     else f"{pad}capabilities: {caps}")
    lines.append(f"{pad}device type {row['device_type']}, backend {row['backend']}")
    runtime = row["runtime"]
    facts = [f"{k}: {v}" for k, v in runtime.items()] if isinstance(runtime, dict) else [str(runtime)]
    lines += [f"{pad}{fact}" for fact in facts]
    return lines


def format_text(info: dict[str, Any]) -> str:
    """The human-readable report."""
    py = info["python"]
    lines = ["Loong environment (paste all of this into a bug report)", "",
             f"Python    {py['version']}  {py['executable']}", f"Platform  {py['platform']}", "",
             "Loong packages"]
    loong = info["loong"]
    lines += _table(loong) if isinstance(loong, dict) and loong else [f"  {loong or '(none found)'}"]
    lines += ["", "Libraries"]
    lines += _table({k: v or "not installed" for k, v in info["libraries"].items()})
    lines += ["", "Engines"]
    lines += _table(info.get("engines") or {})
    lines += ["", f"Accelerators (entry-point group {info['accelerator_group']}, highest priority first)"]
    width = max((len(r["name"]) for r in info["accelerators"]), default=0)
    for row in info["accelerators"]:
        lines += _accelerator_lines(row, width)
    sel = info["selected"]
    lines += ["", f"Selected: {sel['name']}", f"  why: {sel['why']}"] if sel["name"] else \
        ["", "Selected: none", f"  error: {sel['error']}"]
    lines += ["", "Distributed environment"]
    lines += _table({k: "not set" if v is None else v for k, v in info["environment"].items()})
    return "\n".join(lines)


def main(as_json: bool = False, environ: Mapping[str, str] | None = None) -> str:
    """The report as text (or JSON), ready to print."""
    info = collect(environ)
    return json.dumps(info, indent=2) if as_json else format_text(info)


__all__ = ["LIBRARIES", "collect", "environment_vars", "format_text", "loong_packages", "main"]
