"""Cut a release of one Loong package, or check that the workspace is releasable.

    uv run python scripts/release.py <package> <major|minor|patch> [--dry-run]
    uv run python scripts/release.py --check
    uv run python scripts/release.py --verify <package>      # CI on a tag: build + test the tagged version

A release bumps the package's `version` in its pyproject.toml (the one source of its version), moves its
CHANGELOG's `## [Unreleased]` section under `## [<version>] - <date>`, builds the wheel with
`uv build --package <name> --no-sources`, installs it with the sibling Loong wheels it needs (built from the
workspace) in a fresh venv outside the repository, runs the package's tests against the installed wheel and
tags `<package>-v<version>`. `--dry-run` does all of that in a temporary copy of the repository, so the working
tree is left as it was. See docs/releasing.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parent.parent
UNRELEASED = "## [Unreleased]"
LEVELS = ("major", "minor", "patch")
# Why `-x -q` on the package's own tests dir: it is the test the wheel must pass, it stops at the first failure,
# and the slow (multi-process) and gpu tests are deselected, which keeps a dry run in minutes.
TEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-m", "not gpu and not slow")


class ReleaseError(Exception):
    """A release cannot go on; the message says which file or package is wrong."""


def package_dir(root: Path, package: str) -> Path:
    """The folder of `package` (e.g. ``loong-core``) in the workspace at `root`."""
    path = root / "packages" / package
    if not (path / "pyproject.toml").is_file():
        known = ", ".join(workspace_packages(root))
        raise ReleaseError(f"unknown package {package!r}; known: {known}")
    return path


def workspace_packages(root: Path) -> list[str]:
    """Names of every package under `root`/packages."""
    return sorted(p.parent.name for p in (root / "packages").glob("*/pyproject.toml"))


def read_project(root: Path, package: str) -> dict:
    """The `[project]` table of the package's pyproject.toml."""
    return tomllib.loads((package_dir(root, package) / "pyproject.toml").read_text())["project"]


def bumped_version(current: str, level: str) -> str:
    """The release that follows `current` at `level`.

    A dev version ``X.Y.Z.devN`` is the pre-release of ``X.Y.Z``: a bump at a level ``X.Y.Z`` already is at
    (patch always; minor when Z == 0; major when Y == Z == 0) releases ``X.Y.Z`` itself.
    """
    if level not in LEVELS:
        raise ReleaseError(f"level must be one of {', '.join(LEVELS)}, not {level!r}")
    version = Version(current)
    major, minor, patch = (list(version.release) + [0, 0, 0])[:3]
    if version.is_prerelease or version.is_devrelease:
        base = f"{major}.{minor}.{patch}"
        if level == "patch" or (level == "minor" and patch == 0) or (level == "major" and minor == patch == 0):
            return base
    if level == "major":
        return f"{major + 1}.0.0"
    if level == "minor":
        return f"{major}.{minor + 1}.0"
    return f"{major}.{minor}.{patch + 1}"


def set_version(root: Path, package: str, new_version: str) -> None:
    """Rewrite the `version = "..."` line of the package's pyproject.toml."""
    path = package_dir(root, package) / "pyproject.toml"
    text, count = re.subn(r'(?m)^version = "[^"]*"$', f'version = "{new_version}"', path.read_text(), count=1)
    if count != 1:
        raise ReleaseError(f"{path}: no `version = \"...\"` line in [project]")
    path.write_text(text)


def unreleased_entries(changelog_text: str, path: Path) -> str:
    """The body of the `## [Unreleased]` section (stripped; empty when it has no entries)."""
    if UNRELEASED not in changelog_text:
        raise ReleaseError(f"{path}: no '{UNRELEASED}' heading")
    body = changelog_text.split(UNRELEASED, 1)[1]
    return re.split(r"(?m)^## ", body, maxsplit=1)[0].strip()


def move_unreleased(root: Path, package: str, new_version: str, date: dt.date) -> None:
    """Put the Unreleased entries under `## [<new_version>] - <date>`, leaving an empty Unreleased on top."""
    path = package_dir(root, package) / "CHANGELOG.md"
    text = path.read_text()
    if not unreleased_entries(text, path):
        raise ReleaseError(f"{path}: the '{UNRELEASED}' section is empty; say what this release changes")
    heading = f"{UNRELEASED}\n\n## [{new_version}] - {date.isoformat()}"
    path.write_text(text.replace(UNRELEASED, heading, 1))


def run(cmd: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd`, failing with its output when it fails."""
    done = subprocess.run(cmd, cwd=cwd, text=True, capture_output=True, **kwargs)
    if done.returncode != 0:
        raise ReleaseError(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return done


def fresh_venv_env() -> dict[str, str]:
    """The environment for installing into and testing in the fresh venv: no bytecode compiled at install (CI sets
    UV_COMPILE_BYTECODE=1, which compiles all of torch), and the tests' own imports may write theirs
    (PYTHONDONTWRITEBYTECODE would recompile every module in every test process): each module the tests import is
    compiled once, the rest never."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["UV_COMPILE_BYTECODE"] = "0"
    return env


def sibling_closure(root: Path, package: str) -> list[str]:
    """The workspace packages `package` needs at run time (itself first), through its dependencies and extras."""
    names, order = set(workspace_packages(root)), []
    pending = [package]
    while pending:
        name = pending.pop()
        if name in order:
            continue
        order.append(name)
        for spec in read_project(root, name).get("dependencies", []):
            req = Requirement(spec)
            if req.name in names:
                pending.append(req.name)
    return order


def build_and_test(root: Path, package: str, work: Path) -> Path:
    """Build `package` (and the siblings it needs) without workspace sources, install them in a fresh venv in
    `work` and run the package's tests there; returns the package's wheel."""
    dist = work / "dist"
    wheels = []
    for name in sibling_closure(root, package):
        run(["uv", "build", "--package", name, "--no-sources", "--wheel", "--out-dir", str(dist)], cwd=root)
        version = read_project(root, name)["version"]
        found = list(dist.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if len(found) != 1:
            raise ReleaseError(f"expected one wheel of {name} {version} in {dist}, found {found}")
        wheels.append(found[0])
    constraints = work / "constraints.txt"  # third-party versions as uv.lock pins them
    run(["uv", "export", "--frozen", "--all-packages", "--all-extras", "--no-emit-workspace", "--no-hashes",
         "--no-header", "-o", str(constraints)], cwd=root)
    venv = work / "venv"
    run(["uv", "venv", "--python", "3.12", str(venv)], cwd=work)
    python = venv / "bin" / "python"
    # The package's tests use the workspace's test tools (its dev group; the Triton interpreter needs numpy, the
    # serve tests openpi-client), taken with the root's overrides, all at the locked versions.
    root_config = tomllib.loads((root / "pyproject.toml").read_text())
    test_tools = [r for r in root_config["dependency-groups"]["dev"] if Requirement(r).name != "ruff"]
    overrides = work / "overrides.txt"
    overrides.write_text("\n".join(root_config["tool"]["uv"].get("override-dependencies", [])) + "\n")
    # the package with the extras its siblings ask of it (loong-core's `megatron`, which loong-llm requires: the
    # megatron engine is the core's and is tested with it; `flash`, which nothing requires, needs a CUDA build)
    extras = sorted({extra for name in workspace_packages(root) for spec in read_project(root, name).get(
        "dependencies", []) if (req := Requirement(spec)).name == package for extra in req.extras})
    released = f"{package}[{','.join(extras)}] @ {wheels[0].as_uri()}" if extras else str(wheels[0])
    run(["uv", "pip", "install", "--python", str(python), "-c", str(constraints), "--overrides", str(overrides),
         released, *map(str, wheels[1:]), *test_tools], cwd=work, env=fresh_venv_env())
    tests = work / "tests"
    shutil.copytree(package_dir(root, package) / "tests", tests)
    # From a folder outside the repo, so `loong` can only come from the installed wheels.
    done = subprocess.run([str(python), "-m", "pytest", str(tests), *TEST_ARGS, "-o", "addopts=",
                           "--rootdir", str(work), "--basetemp", str(work / "pt")],
                          cwd=work, text=True, capture_output=True, env=fresh_venv_env())
    if done.returncode not in (0, 5):
        raise ReleaseError(f"{package}'s tests failed against the installed wheel:\n{done.stdout[-6000:]}")
    print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "no tests")
    return wheels[0]


def release(package: str, level: str, dry_run: bool, root: Path = REPO_ROOT) -> str:
    """Cut the release; returns the new version. With `dry_run` everything happens in a copy of `root`."""
    current = read_project(root, package)["version"]
    new_version = bumped_version(current, level)
    tag = f"{package}-v{new_version}"
    if run(["git", "tag", "--list", tag], cwd=root).stdout.strip():
        raise ReleaseError(f"tag {tag} exists already")
    with tempfile.TemporaryDirectory(prefix="loong-release-") as tmp:
        work = Path(tmp)
        tree = root
        if dry_run:
            tree = work / "repo"
            ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "dist", "build")
            shutil.copytree(root, tree, ignore=ignore, symlinks=True)
        set_version(tree, package, new_version)
        move_unreleased(tree, package, new_version, dt.date.today())
        started = time.monotonic()
        build_and_test(tree, package, work)
        print(f"{package} {current} -> {new_version}: built and tested in {time.monotonic() - started:.0f} s")
        if dry_run:
            print(f"dry run: would commit the bump and tag {tag}")
            return new_version
    run(["git", "add", f"packages/{package}/pyproject.toml", f"packages/{package}/CHANGELOG.md"], cwd=root)
    run(["git", "commit", "-m", f"Release {package} {new_version}"], cwd=root)
    run(["git", "tag", "-a", tag, "-m", f"{package} {new_version}"], cwd=root)
    print(f"tagged {tag}; push it (git push origin {tag}) to publish")
    return new_version


def verify_tag(package: str, root: Path = REPO_ROOT) -> None:
    """CI on a tag: the tag names the pyproject's version, the changelog has its section, the wheel passes."""
    version = read_project(root, package)["version"]
    text = (package_dir(root, package) / "CHANGELOG.md").read_text()
    if f"## [{version}] - " not in text:
        raise ReleaseError(f"packages/{package}/CHANGELOG.md has no '## [{version}] - <date>' section")
    with tempfile.TemporaryDirectory(prefix="loong-verify-") as tmp:
        build_and_test(root, package, Path(tmp))


def last_tag(root: Path, package: str) -> str:
    """The newest `<package>-v*` tag, or the root commit when the package has none."""
    tags = run(["git", "tag", "--list", f"{package}-v*", "--sort=-v:refname"], cwd=root).stdout.split()
    if tags:
        return tags[0]
    return run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=root).stdout.split()[0]


def sources_changed(root: Path, package: str, since: str) -> bool:
    """Whether anything under packages/<package>/ differs between `since` and the working tree."""
    done = run(["git", "diff", "--name-only", since, "--", f"packages/{package}"], cwd=root)
    untracked = run(["git", "ls-files", "--others", "--exclude-standard", "--", f"packages/{package}"], cwd=root)
    return bool(done.stdout.strip() or untracked.stdout.strip())


def tagged_versions(root: Path, package: str) -> set[Version]:
    """Versions with a `<package>-v<version>` tag."""
    tags = run(["git", "tag", "--list", f"{package}-v*"], cwd=root).stdout.split()
    return {Version(t.removeprefix(f"{package}-v")) for t in tags}


def check(root: Path = REPO_ROOT) -> list[str]:
    """Problems that block a release (empty: releasable).

    1. A package whose files changed since its last tag (or the root commit) has Unreleased entries.
    2. Each sibling range admits the sibling's workspace version, and its lower bound is a version a user can
       get: the workspace version or a tagged one. With one wheel per sibling (the workspace's), uv's
       lowest-direct resolution can pick nothing else, so this is that resolution without building.
    """
    problems = []
    packages = workspace_packages(root)
    versions = {name: Version(read_project(root, name)["version"]) for name in packages}
    for name in packages:
        path = package_dir(root, name) / "CHANGELOG.md"
        since = last_tag(root, name)
        if sources_changed(root, name, since) and not unreleased_entries(path.read_text(), path):
            problems.append(f"{path.relative_to(root)}: files changed since {since[:12]} "
                            f"but '{UNRELEASED}' has no entries")
        for spec in read_project(root, name).get("dependencies", []):
            req = Requirement(spec)
            if req.name not in versions:
                continue
            where = f"packages/{name}/pyproject.toml: {spec!r}"
            if not req.specifier:
                problems.append(f"{where}: a sibling needs a range (e.g. '>=X.Y.Z,<X.(Y+1)')")
                continue
            if not req.specifier.contains(versions[req.name], prereleases=True):
                problems.append(f"{where}: excludes {req.name}'s workspace version {versions[req.name]}")
            lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
            if not lows:
                problems.append(f"{where}: no lower bound")
            elif lows[0] not in tagged_versions(root, req.name) | {versions[req.name]}:
                problems.append(f"{where}: lower bound {lows[0]} is neither {req.name}'s workspace version "
                                f"nor a tagged release")
    return problems


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; exit code 2 on bad input or a failed check."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", nargs="?")
    parser.add_argument("level", nargs="?", choices=LEVELS)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--check", action="store_true", help="changelog and sibling-range checks only")
    parser.add_argument("--verify", action="store_true", help="build and test <package> as it is (CI on a tag)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check()
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            print(f"release check: {len(problems)} problem(s)")
            return 2 if problems else 0
        if args.verify:
            if not args.package:
                parser.error("--verify needs a package")
            verify_tag(args.package)
            return 0
        if not (args.package and args.level):
            parser.error("give <package> <major|minor|patch>, or --check")
        release(args.package, args.level, args.dry_run)
        return 0
    except ReleaseError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
