"""The CLI kit: ``--nproc-per-node`` handling, sub-command dispatch and the one-line error contract."""

from __future__ import annotations

import argparse

import pytest

import loong.core.cli as cli
from loong.core.cli import Command, _strip_launch_options, make_cli
from loong.core.errors import LoongError


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], (0, [])),
        (["train", "a=1"], (0, ["train", "a=1"])),
        (["train", "--nproc-per-node", "4", "a=1"], (4, ["train", "a=1"])),
        (["--nproc-per-node", "2", "train"], (2, ["train"])),
        (["train", "--nproc-per-node=3"], (3, ["train"])),
        (["--nproc-per-node=2", "train", "--nproc-per-node", "8"], (8, ["train"])),  # the last one wins
        (["train", "--nproc-per-node"], (0, ["train", "--nproc-per-node"])),  # dangling: left for argparse
        (["train", "x=--nproc-per-node=2"], (0, ["train", "x=--nproc-per-node=2"])),  # only whole arguments
    ],
)
def test_strip_nproc(argv: list[str], expected: tuple[int, list[str]]) -> None:
    before = list(argv)
    nproc, rest = expected
    assert _strip_launch_options(argv) == ({"--nproc-per-node": nproc} if nproc else {}, rest)
    assert argv == before  # the caller's list is not modified


@pytest.fixture(autouse=True)
def _isolate(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() sets these with setdefault; let monkeypatch put the environment back afterwards.
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    for var in ("RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _cli(run, calls: list | None = None, epilog=None):  # noqa: ANN001, ANN202
    def setup(p: argparse.ArgumentParser) -> None:
        p.add_argument("--x", type=int, default=1)
        p.add_argument("rest", nargs="*")

    def recorded(args: argparse.Namespace) -> int | None:
        if calls is not None:
            calls.append(args)
        return run(args)

    return make_cli(
        "dummy",
        "a dummy tool",
        "dummy.cli",
        {
            "go": Command("do the thing", setup, recorded),
            "other": Command("do another thing", lambda p: None, lambda a: 0),
        },
        epilog=epilog,
    )


def test_dispatches_to_the_command_and_returns_its_code() -> None:
    calls: list = []
    main = _cli(lambda a: 7, calls)
    assert main(["go", "--x", "3", "k=v"]) == 7
    assert calls[0].x == 3 and calls[0].rest == ["k=v"] and calls[0].command == "go"
    assert _cli(lambda a: None)(["go"]) == 0  # None means success


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    main = _cli(lambda a: 0, epilog=lambda: "EPILOG-TEXT")
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dummy")
    assert "go" in out and "do the thing" in out and "other" in out and "--nproc-per-node" in out
    assert "EPILOG-TEXT" in out
    with pytest.raises(SystemExit) as exc:
        main(["go", "--help"])
    assert exc.value.code == 0
    assert "--x" in capsys.readouterr().out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(lambda a: 5)([]) == 0
    assert capsys.readouterr().out.startswith("usage: dummy")


def test_loong_error_is_one_error_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    def fail(args: argparse.Namespace) -> int:
        raise LoongError("train.steps: expected an integer, got 1.5")

    assert _cli(fail)(["go"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "error: train.steps: expected an integer, got 1.5\n"


def test_loong_error_is_printed_by_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(args: argparse.Namespace) -> int:
        raise LoongError("boom")

    monkeypatch.setenv("RANK", "1")
    assert _cli(fail)(["go"]) == 2
    assert capsys.readouterr().err == ""


def test_other_exceptions_are_not_swallowed() -> None:
    def bug(args: argparse.Namespace) -> int:
        raise ValueError("a real bug")

    with pytest.raises(ValueError, match="a real bug"):
        _cli(bug)(["go"])


def test_keyboard_interrupt_exits_130(capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    assert _cli(interrupted)(["go"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_unknown_subcommand_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _cli(lambda a: 0)(["og"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'og'" in err and "usage: dummy" in err


def test_unknown_option_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _cli(lambda a: 0)(["go", "--nope"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--nproc-per-node", "two", "go"], ["go", "--nproc-per-node=2.5"]])
def test_non_integer_nproc_is_one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    calls: list = []
    assert _cli(lambda a: 0, calls)(argv) == 2
    assert not calls
    err = capsys.readouterr().err
    assert err.startswith("error: --nproc-per-node expects an integer") and err.count("\n") == 1
    with pytest.raises(LoongError):
        _strip_launch_options(argv)


def test_nproc_above_one_relaunches_without_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list = []
    monkeypatch.setattr(cli, "relaunch",
                        lambda n, module, argv, max_restarts=0: launched.append((n, module, argv, max_restarts)) or 3)
    calls: list = []
    main = _cli(lambda a: 0, calls)
    assert main(["go", "--nproc-per-node", "2", "k=v"]) == 3
    assert main(["go", "--nproc-per-node", "2", "--max-restarts=1"]) == 3
    assert launched == [(2, "dummy.cli", ["go", "k=v"], 0), (2, "dummy.cli", ["go"], 1)]
    assert not calls  # the parent only launches


@pytest.mark.parametrize("argv", [["--nproc-per-node", "1", "go"], ["go", "--nproc-per-node=0"]])
def test_nproc_of_one_runs_in_process(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    monkeypatch.setattr(cli, "relaunch", lambda *a: pytest.fail("relaunched"))
    assert _cli(lambda a: 4)(argv) == 4


def test_workers_started_by_torchrun_do_not_relaunch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setattr(cli, "relaunch", lambda *a: pytest.fail("relaunched inside torchrun"))
    assert _cli(lambda a: 5)(["go", "--nproc-per-node", "2"]) == 5


def test_max_restarts_is_a_launch_option() -> None:
    found, rest = _strip_launch_options(["train", "--max-restarts", "2", "--nproc-per-node=4", "a=1"])
    assert found == {"--max-restarts": 2, "--nproc-per-node": 4} and rest == ["train", "a=1"]
    with pytest.raises(LoongError, match="--max-restarts expects an integer"):
        _strip_launch_options(["--max-restarts=x"])
