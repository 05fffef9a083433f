"""Helpers for the modality packages' bad-input tests: the clean-failure contract and a checkpoint corpus.

The house rule for bad input is one contract for every Loong CLI: exit code 2, exactly one ``error: ...`` line on
stderr, no traceback, nothing on stdout and nothing written (no output directory, nothing in the working directory,
an existing output left byte for byte). :func:`expect_clean_failure` asserts all of it around one in-process
``main(argv)`` call, :func:`clean_failure_cli` makes the per-test runner the corpus tests call, :func:`unchanged`
asserts that a folder is left as it was, and :func:`write_checkpoint_corpus` writes the foreign / newer-format /
truncated checkpoints every CLI must refuse. Plain ``assert`` statements (no pytest import), so that the module
costs nothing outside tests; pytest shows their messages.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from loong.core.checkpoint import MANIFEST, CheckpointManager

# A loong-llm pretraining run's config: what the other modalities' CLIs must refuse as "not one of mine".
LLM_CONFIG: dict[str, Any] = {"task": "pretrain", "model": {"family": "llama", "num_layers": 2, "hidden_size": 64}}
NEWER_FORMAT = 99  # the manifest format of the "newer" checkpoint: far above any format this Loong reads


def expect_clean_failure(main: Callable[[list[str]], int | None], argv: Sequence[str], *, cwd: Path,
                         out: Path | None = None, out_may_hold: Collection[str] = ()) -> str:
    """Run ``main(argv)`` from the empty folder ``cwd`` (made if missing) and assert the clean-failure contract.

    Asserted: the exit code is 2; stderr is exactly one line starting with ``error: ``; no traceback; nothing on
    stdout; ``cwd`` is still empty; ``out`` (the run's output directory, if given) does not exist or, if
    ``out_may_hold`` names entries (a cache the CLI may fill before it fails), holds exactly those. Returns the
    ``error: ...`` line.
    """
    cwd.mkdir(parents=True, exist_ok=True)
    assert list(cwd.iterdir()) == [], f"{cwd} must be empty before the command"  # else the check below proves nothing
    err, stdout = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stderr(err), contextlib.redirect_stdout(stdout):
        rc = main(list(argv))
    text = err.getvalue()
    lines = text.strip().splitlines()
    assert rc == 2, (rc, text[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), text[-3000:]
    assert "Traceback" not in text and stdout.getvalue() == "", (text[-3000:], stdout.getvalue()[-3000:])
    if out is not None:
        held = sorted(p.name for p in out.iterdir()) if out.exists() else None
        assert held is None or (out_may_hold and held == sorted(out_may_hold)), \
            f"a failed command must not create its output directory {out} (it holds {held})"
    assert list(cwd.iterdir()) == [], "a failed command must not write into the working directory"
    return lines[0]


def clean_failure_cli(main: Callable[[list[str]], int | None], folder: Path, *, train: Sequence[str] = (),
                      out_may_hold: Collection[str] = ()) -> Callable[..., str]:
    """``cli(*argv)``: :func:`expect_clean_failure` of ``main(argv)`` from ``folder/cwd``; returns the error line.

    A ``train`` command gets ``train`` (a cheap run's overrides) and ``output_dir=folder/out`` before its own
    arguments, and ``folder/out`` is checked to stay absent (but for ``out_may_hold``).
    """
    out = folder / "out"

    def run(*argv: str) -> str:
        if argv and argv[0] == "train":
            argv = ("train", *train, f"output_dir={out}", *argv[1:])
        return expect_clean_failure(main, argv, cwd=folder / "cwd", out=out, out_may_hold=out_may_hold)

    return run


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its relative path, with its bytes (to compare a folder before and after)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def unchanged(folder: Path, *, copy_of: Path | None = None) -> Iterator[Path]:
    """Assert that ``folder`` is left byte for byte as it was by the ``with`` body; yields ``folder``.

    ``copy_of``: first fill ``folder`` (which must not exist) with a copy of that folder (a good earlier output).
    """
    if copy_of is not None:
        shutil.copytree(copy_of, folder)
    before = snapshot(folder)
    yield folder
    after = snapshot(folder)
    changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    assert not changed, f"a failed command must leave the existing output {folder} as it was; changed: {changed}"


class _Weights:
    """The slice of an engine that :class:`CheckpointManager` needs: one 256-byte weights file."""

    def save(self, directory: Path) -> None:
        (directory / "weights.bin").write_bytes(b"\0" * 256)


def write_checkpoint_corpus(folder: Path, *, config: Mapping[str, Any] = LLM_CONFIG,
                            base: Path | None = None) -> dict[str, Path]:
    """Write the checkpoints every CLI must refuse into ``folder``; returns them by kind.

    - ``foreign`` (``folder/foreign_ckpt``): a step-0 weights-only checkpoint, written by the core's
      :class:`CheckpointManager`, whose config is ``config`` (default: a loong-llm run's, :data:`LLM_CONFIG`; a
      loong-llm test passes another modality's) and whose weights are one 256-byte ``weights.bin``;
    - ``newer`` (``folder/newer_ckpt``): a copy of ``base`` (a run folder holding ``checkpoints/``; default the
      foreign one) whose manifest says format :data:`NEWER_FORMAT`;
    - ``truncated`` (``folder/truncated_ckpt``): a copy of ``base`` whose largest file is cut to half its size.
    """
    foreign = folder / "foreign_ckpt"
    CheckpointManager(foreign / "checkpoints").save(0, _Weights(), {"step": 0, "weights_only": True}, dict(config))
    base = foreign if base is None else base
    step = next((base / "checkpoints").glob("step_*")).relative_to(base)  # base holds one step
    newer, truncated = folder / "newer_ckpt", folder / "truncated_ckpt"
    shutil.copytree(base, newer)
    manifest = newer / step / MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": NEWER_FORMAT}))
    shutil.copytree(base, truncated)
    files = json.loads((truncated / step / MANIFEST).read_text())["files"]
    largest = truncated / step / max(files, key=lambda name: files[name]["size"])
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    return {"foreign": foreign, "newer": newer, "truncated": truncated}
