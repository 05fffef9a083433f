"""scripts/release.py: version bump, changelog move, the --check rules on a temporary git repo, the repo itself."""

from __future__ import annotations

import datetime as dt
import importlib.util
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("loong_release", REPO_ROOT / "scripts" / "release.py")
release = importlib.util.module_from_spec(_spec)
sys.modules["loong_release"] = release
_spec.loader.exec_module(release)


@pytest.mark.parametrize(("current", "level", "expected"), [
    ("0.1.0.dev0", "patch", "0.1.0"), ("0.1.0.dev0", "minor", "0.1.0"), ("0.1.0.dev0", "major", "1.0.0"),
    ("0.1.0", "patch", "0.1.1"), ("0.1.3", "minor", "0.2.0"), ("0.2.1", "major", "1.0.0"),
    ("1.2.3.dev1", "patch", "1.2.3"), ("1.2.3.dev1", "minor", "1.3.0"), ("1.0.0.dev0", "major", "1.0.0"),
])
def test_bumped_version(current: str, level: str, expected: str) -> None:
    assert release.bumped_version(current, level) == expected


def test_bad_level_fails() -> None:
    with pytest.raises(release.ReleaseError, match="level must be one of"):
        release.bumped_version("0.1.0", "huge")


def _workspace(root: Path, deps: dict[str, list[str]], versions: dict[str, str]) -> None:
    for name, requires in deps.items():
        folder = root / "packages" / name
        (folder / "src").mkdir(parents=True)
        listed = ", ".join(f'"{r}"' for r in requires)
        (folder / "pyproject.toml").write_text(
            f'[project]\nname = "{name}"\nversion = "{versions[name]}"\ndependencies = [{listed}]\n')
        (folder / "CHANGELOG.md").write_text(f"# Changelog — {name}\n\n## [Unreleased]\n\n")
        (folder / "src" / "a.py").write_text("x = 1\n")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, text=True, capture_output=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _workspace(tmp_path, {"loong-a": [], "loong-b": ["loong-a>=0.1.0.dev0,<0.2", "numpy"]},
               {"loong-a": "0.1.0.dev0", "loong-b": "0.1.0.dev0"})
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "root")
    return tmp_path


def test_set_version_and_move_unreleased(repo: Path) -> None:
    log = repo / "packages/loong-a/CHANGELOG.md"
    log.write_text(log.read_text() + "### Added\n- a thing\n\n## [0.0.9] - 2026-01-01\n- old\n")
    release.set_version(repo, "loong-a", "0.1.0")
    release.move_unreleased(repo, "loong-a", "0.1.0", dt.date(2026, 12, 2))
    assert release.read_project(repo, "loong-a")["version"] == "0.1.0"
    assert log.read_text() == ("# Changelog — loong-a\n\n## [Unreleased]\n\n## [0.1.0] - 2026-12-02\n\n"
                               "### Added\n- a thing\n\n## [0.0.9] - 2026-01-01\n- old\n")
    with pytest.raises(release.ReleaseError, match="section is empty"):
        release.move_unreleased(repo, "loong-b", "0.1.0", dt.date(2026, 12, 2))


def test_check_without_tags_needs_entries_for_changed_packages(repo: Path) -> None:
    # Nothing changed since the root commit: nothing to say yet.
    assert release.check(repo) == []
    (repo / "packages/loong-a/src/a.py").write_text("x = 2\n")
    problems = release.check(repo)
    assert len(problems) == 1 and "packages/loong-a/CHANGELOG.md" in problems[0]
    log = repo / "packages/loong-a/CHANGELOG.md"
    log.write_text(log.read_text() + "### Fixed\n- x is 2\n")
    assert release.check(repo) == []


def test_check_compares_against_the_last_tag(repo: Path) -> None:
    (repo / "packages/loong-b/src/a.py").write_text("x = 2\n")
    _git(repo, "commit", "-qam", "change b")
    assert any("loong-b" in p for p in release.check(repo))
    _git(repo, "tag", "loong-b-v0.1.0.dev0")
    assert release.check(repo) == []


@pytest.mark.parametrize(("spec", "message"), [
    ("loong-a", "needs a range"),
    ("loong-a>=0.2.0,<0.3", "excludes loong-a's workspace version"),
    ("loong-a>=0.0.5,<0.2", "lower bound 0.0.5 is neither"),
    ("loong-a<0.2", "no lower bound"),
])
def test_check_sibling_ranges(repo: Path, spec: str, message: str) -> None:
    path = repo / "packages/loong-b/pyproject.toml"
    path.write_text(path.read_text().replace("loong-a>=0.1.0.dev0,<0.2", spec))
    _git(repo, "commit", "-qam", "range")
    _git(repo, "tag", "loong-b-v0.1.0.dev0")
    problems = release.check(repo)
    assert any(message in p for p in problems), problems
    _git(repo, "tag", "loong-a-v0.0.5")  # a released lower bound is fine
    assert ("neither" in message) == (release.check(repo) == [])


def test_the_workspace_passes_its_check() -> None:
    assert release.check(REPO_ROOT) == []


def test_versions_come_from_pyproject() -> None:
    import loong.core
    import loong.kernels
    assert loong.core.__version__ == version("loong-core") == release.read_project(REPO_ROOT, "loong-core")["version"]
    assert loong.kernels.__version__ == version("loong-kernels")


def test_unknown_package_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert release.main(["loong-nope", "patch", "--dry-run"]) == 2
    assert "unknown package 'loong-nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_dry_run_of_loong_xpu_leaves_the_tree_unchanged() -> None:
    # loong-xpu: the smallest package's tests (about 20 s) with a sibling wheel to build (loong-core); each package's
    # own dry run is in issue 24's closing note (docs/releasing.md)
    # The files a release edits, by content: the rest of a shared working tree may change meanwhile.
    edited = [REPO_ROOT / "packages/loong-xpu" / name for name in ("pyproject.toml", "CHANGELOG.md")]
    before = [p.read_bytes() for p in edited]
    tags = subprocess.run(["git", "tag"], cwd=REPO_ROOT, text=True, capture_output=True).stdout
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, text=True, capture_output=True).stdout
    new = release.release("loong-xpu", "patch", dry_run=True)
    assert new == release.bumped_version(release.read_project(REPO_ROOT, "loong-xpu")["version"], "patch")
    assert [p.read_bytes() for p in edited] == before
    assert subprocess.run(["git", "tag"], cwd=REPO_ROOT, text=True, capture_output=True).stdout == tags
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, text=True, capture_output=True).stdout == head
