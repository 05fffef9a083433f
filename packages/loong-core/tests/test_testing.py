"""``loong.core.testing``: the clean-failure checks reject every way a command can break the contract.

The modality packages' bad-input tests only see these helpers pass; here each clause is shown to fail when the
command breaks it (fake ``main`` functions, no CLI), so that a passing corpus test means something.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loong.core.testing import clean_failure_cli, expect_clean_failure, unchanged


def _fails(rc: int = 2, err: str = "error: bad key\n", out: str = "", write: str | None = None):  # noqa: ANN202
    """A fake ``main``: prints ``err`` / ``out``, writes the file ``write`` (relative to the cwd) and returns ``rc``."""
    def main(argv: list[str]) -> int:
        print(err, end="", file=sys.stderr)
        print(out, end="")
        if write is not None:
            Path(write).parent.mkdir(parents=True, exist_ok=True)
            Path(write).write_text("x")
        return rc

    return main


def test_a_clean_failure_returns_its_line(tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def main(argv: list[str]) -> int:
        seen.append(argv)
        assert Path.cwd() == tmp_path / "cwd"  # run from the empty cwd
        print("error: train.steps=abc: not an integer", file=sys.stderr)
        return 2

    run = clean_failure_cli(main, tmp_path, train=["train.steps=1"])
    assert run("train", "a=b") == "error: train.steps=abc: not an integer"
    assert run("convert", "x", "y") == "error: train.steps=abc: not an integer"
    assert seen == [["train", "train.steps=1", f"output_dir={tmp_path / 'out'}", "a=b"], ["convert", "x", "y"]]
    assert Path.cwd() != tmp_path / "cwd"  # the cwd is restored


BROKEN = [  # (a command that breaks one clause of the contract, which)
    (_fails(rc=1), "exit code 1"),
    (_fails(rc=0), "exit code 0"),
    (_fails(err=""), "no error line"),
    (_fails(err="error: one\nerror: two\n"), "two lines"),
    (_fails(err="warning: bad key\n"), "no error prefix"),
    (_fails(err="error: Traceback (most recent call last)\n"), "a traceback"),
    (_fails(out="wrote it\n"), "stdout"),
    (_fails(write="stray.txt"), "writes into the cwd"),
    (_fails(write="../out/run/config.yaml"), "makes the output directory"),
]


@pytest.mark.parametrize("main,why", BROKEN, ids=[why for _, why in BROKEN])
def test_each_broken_clause_fails(tmp_path: Path, main, why: str) -> None:  # noqa: ANN001
    with pytest.raises(AssertionError):
        expect_clean_failure(main, ["train"], cwd=tmp_path / "cwd", out=tmp_path / "out")


def test_out_may_hold_only_what_it_names(tmp_path: Path) -> None:
    cache = _fails(write="../out/.cache/blob")
    assert expect_clean_failure(cache, [], cwd=tmp_path / "a", out=tmp_path / "out", out_may_hold=[".cache"])
    with pytest.raises(AssertionError):  # a run directory next to the cache
        expect_clean_failure(_fails(write="../out/run/x"), [], cwd=tmp_path / "a", out=tmp_path / "out",
                             out_may_hold=[".cache"])


def test_a_non_empty_cwd_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "old.txt").write_text("x")
    with pytest.raises(AssertionError, match="must be empty before"):
        expect_clean_failure(_fails(), [], cwd=tmp_path / "cwd")


def test_unchanged_names_the_changed_files(tmp_path: Path) -> None:
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "a.txt").write_text("a")
    (tmp_path / "good" / "b.txt").write_text("b")
    with unchanged(tmp_path / "dst", copy_of=tmp_path / "good") as dst:
        assert (dst / "a.txt").read_text() == "a"
    for edit in (lambda d: (d / "a.txt").write_text("A"), lambda d: (d / "b.txt").unlink(),
                 lambda d: (d / "c.txt").write_text("c")):
        with pytest.raises(AssertionError, match=r"changed: \['(a|b|c)\.txt'\]"):
            with unchanged(tmp_path / "good"):
                edit(tmp_path / "good")
        (tmp_path / "good" / "a.txt").write_text("a")  # put it back for the next edit
        (tmp_path / "good" / "b.txt").write_text("b")
        (tmp_path / "good" / "c.txt").unlink(missing_ok=True)
