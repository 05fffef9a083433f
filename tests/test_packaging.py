"""Packaging checks: every workspace member builds a sane wheel, and the installed wheels work outside the repo.

What this guards:
- each of the seven members builds (sdist, then a wheel from that sdist) with ``uv build --package``;
- ``loong`` stays a namespace package: no wheel may ship ``loong/__init__.py``;
- each wheel ships only its own ``loong/<name>/`` subpackage (no member swallows another's code);
- the loong-llm wheel carries its YAML presets under ``loong/llm/configs/``;
- loong-core + loong-kernels + loong-llm install into a fresh venv outside the repo and ``loong-llm --help`` runs.

The install pins third-party versions to ``uv.lock`` (through ``uv export`` constraints) and hard-links from uv's
cache, which the workspace sync has already filled, so nothing large is downloaded (about 6 s on the CI machine).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[1]

# distribution name -> the subpackage of the ``loong`` namespace it owns
MEMBERS = {
    "loong-core": "core",
    "loong-kernels": "kernels",
    "loong-llm": "llm",
    "loong-vlm": "vlm",
    "loong-diffusion": "diffusion",
    "loong-embodied": "embodied",
    "loong-xpu": "xpu",
}
INSTALLED = ["loong-core", "loong-kernels", "loong-llm"]


def _uv() -> str:
    """The uv executable: the one running us (``uv run`` sets $UV), else PATH, else the ``uv`` Python package."""
    candidates = [os.environ.get("UV"), shutil.which("uv")]
    try:
        import uv  # type: ignore[import-not-found]

        candidates.append(uv.find_uv_bin())
    except Exception:  # the uv module is optional
        pass
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    pytest.skip("uv is not available")


def _clean_env() -> dict[str, str]:
    """Environment for subprocesses: nothing that points back at the workspace venv or the source tree."""
    env = dict(os.environ)
    for key in (
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "PYTHONHOME",
        "UV_PROJECT_ENVIRONMENT",
        # Compiling bytecode for torch & co. in the throw-away venv would cost ~45 s.
        "UV_COMPILE_BYTECODE",
        "CONDA_PREFIX",
    ):
        env.pop(key, None)
    return env


def _run(cmd: list[str], *, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (
        f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
    return proc


def _wheel_for(dist_dir: Path, dist: str) -> Path:
    wheels = sorted(dist_dir.glob(f"{dist.replace('-', '_')}-*.whl"))
    assert len(wheels) == 1, f"expected exactly one wheel for {dist} in {dist_dir}, found {wheels}"
    return wheels[0]


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build every member with ``uv build --package <name>`` (concurrently); return dist name -> wheel path."""
    uv = _uv()
    out = tmp_path_factory.mktemp("dist")
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(MEMBERS)) as pool:
        jobs = {
            dist: pool.submit(
                _run, [uv, "build", "--package", dist, "--out-dir", str(out / dist), "--quiet"], cwd=REPO_ROOT
            )
            for dist in MEMBERS
        }
        for job in jobs.values():
            job.result()  # re-raises the first failure with its output
    print(f"\nbuilt {len(MEMBERS)} packages in {time.monotonic() - t0:.1f} s")
    return {dist: _wheel_for(out / dist, dist) for dist in MEMBERS}


def test_every_member_builds_a_wheel(built: dict[str, Path]) -> None:
    for dist, wheel in built.items():
        assert wheel.is_file() and wheel.stat().st_size > 0, dist
        # the sdist was built too (uv builds the wheel from it), so it is the sdist that was proven complete
        assert list(wheel.parent.glob(f"{dist.replace('-', '_')}-*.tar.gz")), f"no sdist for {dist}"


def test_loong_is_a_namespace_package(built: dict[str, Path]) -> None:
    offenders = {dist: wheel.name for dist, wheel in built.items() if "loong/__init__.py" in _names(wheel)}
    assert not offenders, f"wheels ship loong/__init__.py (breaks the shared namespace): {offenders}"


def test_each_wheel_ships_only_its_own_subpackage(built: dict[str, Path]) -> None:
    for dist, wheel in built.items():
        own = f"loong/{MEMBERS[dist]}/"
        stray = [
            n
            for n in _names(wheel)
            if not n.startswith(own) and not n.split("/", 1)[0].endswith(".dist-info")
        ]
        assert not stray, f"{wheel.name} ships files outside {own}: {stray[:20]}"
        assert any(n == own + "__init__.py" for n in _names(wheel)), f"{wheel.name} has no {own}__init__.py"


def test_llm_wheel_ships_yaml_configs(built: dict[str, Path]) -> None:
    names = _names(built["loong-llm"])
    yamls = [n for n in names if n.startswith("loong/llm/configs/") and n.endswith((".yaml", ".yml"))]
    assert yamls, "loong-llm wheel has no package data under loong/llm/configs/*.yaml"


def test_llm_wheel_declares_console_script(built: dict[str, Path]) -> None:
    with zipfile.ZipFile(built["loong-llm"]) as zf:
        ep = next(n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt"))
        text = zf.read(ep).decode()
    assert "[console_scripts]" in text and "loong-llm" in text, text


@pytest.fixture(scope="module")
def installed_venv(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv outside the repo with loong-core, loong-kernels and loong-llm installed from the built wheels."""
    uv = _uv()
    work = tmp_path_factory.mktemp("venv")
    venv = work / "venv"
    assert REPO_ROOT not in venv.resolve().parents, "the test venv must live outside the repo"

    t0 = time.monotonic()
    _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], cwd=work)

    cmd = [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), "--link-mode=hardlink"]
    lock = REPO_ROOT / "uv.lock"
    if lock.is_file():
        # Pin third-party packages to the lock: reproducible, and all of them are already in uv's cache.
        constraints = work / "constraints.txt"
        _run(
            [
                uv, "export", "--frozen", "--all-packages", "--no-emit-workspace", "--no-hashes", "--no-dev",
                "--quiet", "--output-file", str(constraints),
            ],
            cwd=REPO_ROOT,
        )  # fmt: skip
        cmd += ["--constraint", str(constraints)]
    cmd += [str(built[d]) for d in INSTALLED]
    _run(cmd, cwd=work, timeout=600)
    print(f"\ncreated venv and installed {INSTALLED} in {time.monotonic() - t0:.1f} s")
    return venv


def test_installed_packages_come_from_the_venv(installed_venv: Path, tmp_path: Path) -> None:
    code = (
        "import loong, loong.core, loong.kernels, loong.llm\n"
        "assert getattr(loong, '__file__', None) is None, loong.__file__\n"
        "for m in (loong.core, loong.kernels, loong.llm): print(m.__file__)\n"
    )
    proc = _run([str(installed_venv / "bin" / "python"), "-c", code], cwd=tmp_path)
    site = str(installed_venv.resolve())
    for line in proc.stdout.split():
        assert str(Path(line).resolve()).startswith(site), f"{line} was not imported from the test venv"


def test_loong_llm_help_runs_outside_the_repo(installed_venv: Path, tmp_path: Path) -> None:
    exe = installed_venv / "bin" / "loong-llm"
    assert exe.is_file(), "the loong-llm console script was not installed"
    t0 = time.monotonic()
    proc = _run([str(exe), "--help"], cwd=tmp_path, timeout=300)
    print(f"\nloong-llm --help took {time.monotonic() - t0:.1f} s")
    out = proc.stdout + proc.stderr
    assert "model" in out.lower(), f"`loong-llm --help` does not mention model presets:\n{out}"
