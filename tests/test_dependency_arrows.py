"""The dependency arrows of ARCHITECTURE.md, checked from what each package declares and what it imports.

Arrows point down only: a package may depend on (and import) the packages below it, never one beside or above it.
Read from each package's ``pyproject.toml`` (``[project] dependencies``, extras included) and from every
``import loong.<pkg>`` / ``from loong.<pkg>`` in its ``src/`` tree.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: package -> the Loong packages it may depend on (ARCHITECTURE.md, "Dependency direction")
ALLOWED: dict[str, set[str]] = {
    "loong-kernels": set(),
    "loong-core": {"loong-kernels"},
    "loong-llm": {"loong-core", "loong-kernels"},
    "loong-vlm": {"loong-llm", "loong-core", "loong-kernels"},
    "loong-diffusion": {"loong-core", "loong-kernels"},
    "loong-embodied": {"loong-core", "loong-kernels"},
    "loong-xpu": {"loong-core", "loong-kernels"},
}
#: the import name of each package (``loong.<name>``)
MODULE = {pkg: pkg.removeprefix("loong-") for pkg in ALLOWED}


def declared(pkg: str) -> set[str]:
    """The Loong packages ``pkg``'s pyproject.toml depends on (optional extras included)."""
    project = tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    names = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].strip().lower() for r in reqs}
    return {n for n in names if n.startswith("loong-")} - {pkg}


def imported(pkg: str) -> dict[str, str]:
    """The other Loong packages ``pkg``'s sources import -> the first file:line that does."""
    found: dict[str, str] = {}
    modules = {mod: name for name, mod in MODULE.items()}
    for path in sorted((ROOT / "packages" / pkg / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if len(parts) >= 2 and parts[0] == "loong" and parts[1] in modules:
                    other = modules[parts[1]]
                    if other != pkg:
                        found.setdefault(other, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_package_is_listed() -> None:
    on_disk = {p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()}
    assert on_disk == set(ALLOWED), f"packages without arrows in this test: {sorted(on_disk ^ set(ALLOWED))}"


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_declared_dependencies_point_down(pkg: str) -> None:
    bad = declared(pkg) - ALLOWED[pkg]
    assert not bad, f"{pkg} declares {sorted(bad)}: arrows may only point to {sorted(ALLOWED[pkg]) or 'nothing'}"


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_imports_point_down_and_are_declared(pkg: str) -> None:
    uses = imported(pkg)
    sideways = {k: v for k, v in uses.items() if k not in ALLOWED[pkg]}
    assert not sideways, f"{pkg} imports packages it may not depend on: {sideways}"
    # an import of a package reached only through another one's dependencies is still a dependency to declare
    undeclared = {k: v for k, v in uses.items() if k not in declared(pkg)}
    assert not undeclared, f"{pkg} imports packages its pyproject.toml does not declare: {undeclared}"


def test_the_scan_finds_imports() -> None:
    """The import scan finds what it must (a guard against a scan that silently finds nothing)."""
    uses = imported("loong-vlm")
    assert "loong-llm" in uses and "loong-core" in uses


def wheel_requires(wheel: Path) -> set[str]:
    """The Loong distributions a built wheel's METADATA ``Requires-Dist`` names (extras' requirements included)."""
    import email.parser
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        headers = email.parser.Parser().parsestr(zf.read(meta).decode())
    names = {re.split(r"[\s\[<>=!~;(]", r, maxsplit=1)[0].strip().lower().replace("_", "-")
             for r in headers.get_all("Requires-Dist") or []}
    return {n for n in names if n.startswith("loong-")}


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_wheel_requires_point_down(pkg: str, built_wheels: dict[str, Path]) -> None:
    """What the built wheel asks an installer for, not only what pyproject.toml says, points down."""
    requires = wheel_requires(built_wheels[pkg])
    bad = requires - ALLOWED[pkg]
    assert not bad, f"{built_wheels[pkg].name} Requires-Dist {sorted(bad)}: arrows may only point to " \
                    f"{sorted(ALLOWED[pkg]) or 'nothing'}"
    # the wheel and the pyproject agree: a build backend that drops or adds a sibling is caught here
    assert requires - {pkg} == declared(pkg), (requires, declared(pkg))


@pytest.mark.parametrize("pkg", ["loong-llm", "loong-vlm"])
def test_the_megatron_packages_take_the_cores_megatron_extra(pkg: str) -> None:
    """loong-core needs megatron-core only through its ``megatron`` extra; the packages that train on the megatron
    engine must ask for it."""
    from packaging.requirements import Requirement

    specs = tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())["project"]["dependencies"]
    core = [Requirement(s) for s in specs if Requirement(s).name == "loong-core"]
    assert core and "megatron" in core[0].extras, specs
