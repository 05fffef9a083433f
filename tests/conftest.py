"""Session fixtures shared by the repository-root tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: every workspace member (a folder of packages/ with a pyproject.toml)
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


def uv() -> str:
    """The uv executable (the one running this session's ``uv run``, else the first on PATH)."""
    found = os.environ.get("UV") or shutil.which("uv")
    if not found:
        raise RuntimeError("uv is not on PATH: the wheel tests build and install with it")
    return found


@pytest.fixture(scope="session")
def built_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every package's wheel, built once per session with ``uv build --package <name> --wheel`` -> name: path."""
    out = tmp_path_factory.mktemp("wheels")
    wheels: dict[str, Path] = {}
    for pkg in PACKAGES:
        subprocess.run([uv(), "build", "--package", pkg, "--wheel", "-q", "-o", str(out)], cwd=ROOT, check=True)
        found = sorted(out.glob(f"{pkg.replace('-', '_')}-*.whl"))
        assert len(found) == 1, f"uv build --package {pkg} left {found} in {out}"
        wheels[pkg] = found[0]
    return wheels
