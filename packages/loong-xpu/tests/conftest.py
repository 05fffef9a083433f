"""The simulated Kunlun runtime (``simulated_kunlun_runtime.py``), loaded by path.

Tests import with ``--import-mode=importlib``, so a helper module beside them is not on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load_simulation() -> ModuleType:
    name = "simulated_kunlun_runtime"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def sim() -> ModuleType:
    """The simulation module: ``sim.SimulatedKunlunHost(...)`` builds a simulated process."""
    return _load_simulation()
