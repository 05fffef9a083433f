"""What every benchmark records beside its figures (package versions and the machine), and how it runs a child.

Importing this module makes SIGTERM (what ``timeout`` sends) end the benchmark *and* the process groups of the
children started by :func:`run_child`: a ``loong-llm train`` child left running would keep its GPU memory and
make the next run fail to allocate.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import threading
from importlib import metadata
from pathlib import Path

_CHILD_GROUPS: set[int] = set()  # process groups of the running children of this benchmark process


def _kill_children() -> None:
    for group in list(_CHILD_GROUPS):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _on_sigterm(signum: int, frame: object) -> None:
    _kill_children()
    raise SystemExit(128 + signum)


if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_sigterm)


def run_child(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, env=env)`` in its own process group (torchrun's
    workers included), which is killed if this benchmark is terminated or interrupted."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    _CHILD_GROUPS.add(proc.pid)
    try:
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C, SystemExit): take the whole group down
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _CHILD_GROUPS.discard(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def versions(names: list[str]) -> dict:
    """Python's version and each installed distribution's (None when absent)."""
    out: dict = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def host() -> dict:
    """CPU model and count, platform, load average, and the GPUs torch sees (if torch is importable)."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"cpu": model, "cpu_count": os.cpu_count(), "platform": platform.platform(),
           "load_average_before": os.getloadavg()}
    try:
        import torch
    except ImportError:
        return out
    if torch.cuda.is_available():
        out.update(gpu=torch.cuda.get_device_name(), gpu_count=torch.cuda.device_count(),
                   gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return out
