"""CheckpointManager: a failed save never disturbs the last good checkpoint; pruning; path resolution.

Unit tests with fake engines (plain files, no megatron, no process group): ``CheckpointManager`` only
calls ``engine.save(directory)`` and, outside a process group, its barriers are no-ops.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loong.core.checkpoint import (
    CONFIG_FILE,
    LATEST,
    STATE_FILE,
    CheckpointManager,
    read_config,
    read_state,
    resolve_checkpoint,
    step_dir_name,
)
from loong.core.errors import LoongError


class FakeEngine:
    """Writes one shard file whose content names the step (so a mix-up between steps shows)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.saved_to: list[Path] = []

    def save(self, directory: Path) -> None:
        self.saved_to.append(Path(directory))
        (Path(directory) / "shard.bin").write_bytes(self.tag.encode() * 100)
        (Path(directory) / ".metadata").write_text(self.tag)


class CrashingEngine:
    """Writes part of a shard, then fails, like a save killed half-way."""

    def save(self, directory: Path) -> None:
        (Path(directory) / "shard.bin").write_bytes(b"partial")
        raise OSError("disk full")


def _save(mgr: CheckpointManager, step: int, engine=None, artifacts=None) -> Path:  # noqa: ANN001
    engine = engine or FakeEngine(f"step{step}")
    return mgr.save(step, engine, {"step": step, "loss": 1.0 / step}, {"train": {"steps": 10}},
                    artifacts=artifacts)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_save_writes_complete_step_and_latest(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "checkpoints")
    assert mgr.latest() is None  # nothing yet (the folder does not even exist)
    engine = FakeEngine("step1")
    out = mgr.save(1, engine, {"step": 1, "loss": 2.5}, {"model": {"hidden_size": 64}},
                   artifacts=lambda d: (d / "tokenizer").mkdir())
    assert out == tmp_path / "checkpoints" / "step_00000001" == mgr.latest()
    assert engine.saved_to == [tmp_path / "checkpoints" / ".step_00000001.tmp"]  # written aside, then renamed
    assert (tmp_path / "checkpoints" / LATEST).read_text().strip() == "step_00000001"
    assert read_state(out) == {"step": 1, "loss": 2.5}
    assert read_config(out) == {"model": {"hidden_size": 64}}
    assert (out / "shard.bin").read_bytes() == b"step1" * 100
    assert (out / "tokenizer").is_dir()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("where", ["engine", "artifacts"])
def test_failed_save_keeps_previous_checkpoint(tmp_path: Path, where: str) -> None:
    root = tmp_path / "checkpoints"
    mgr = CheckpointManager(root, keep_last=1)  # even the most aggressive pruning must not bite
    step1 = _save(mgr, 1)
    before = _snapshot(step1)

    def bad_artifacts(d: Path) -> None:
        (d / "tokenizer").mkdir()
        raise OSError("no space left")

    with pytest.raises(OSError):
        if where == "engine":
            _save(mgr, 2, engine=CrashingEngine())
        else:
            _save(mgr, 2, artifacts=bad_artifacts)

    # the pointer and the previous step are untouched; the half-written step stays hidden
    assert (root / LATEST).read_text() == "step_00000001\n"
    assert mgr.latest() == step1 == resolve_checkpoint(root) == resolve_checkpoint(tmp_path)
    assert _snapshot(step1) == before
    assert not (root / "step_00000002").exists()
    stale = root / ".step_00000002.tmp"
    assert stale.is_dir()
    if where == "engine":
        assert (stale / "shard.bin").read_bytes() == b"partial"
    # a fresh manager (a restarted run) sees the same
    assert CheckpointManager(root).latest() == step1

    # a later successful save of the same step replaces the stale temporary directory
    (root / ".step_00000007.tmp").mkdir()  # a leftover of another step is cleaned too
    step2 = _save(mgr, 2)
    assert step2 == mgr.latest() == root / "step_00000002"
    assert _snapshot(step2)["shard.bin"] == b"step2" * 100
    assert "tokenizer" not in {p.name for p in step2.iterdir()}  # nothing of the failed attempt
    assert read_state(step2)["step"] == 2
    assert sorted(p.name for p in root.iterdir()) == [LATEST, "step_00000002"]  # keep_last=1


def test_keep_last_keeps_newest(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    mgr = CheckpointManager(root, keep_last=2)
    for step in (1, 2, 3, 10, 11):  # 10 > 3 numerically: names are zero-padded so order is right
        _save(mgr, step)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000010", "step_00000011"]
    assert mgr.latest() == root / "step_00000011"
    assert read_state(root / "step_00000010")["step"] == 10

    keep_all = CheckpointManager(tmp_path / "all", keep_last=0)
    for step in (1, 2, 3):
        _save(keep_all, step)
    assert sorted(p.name for p in (tmp_path / "all").glob("step_*")) == [step_dir_name(s) for s in (1, 2, 3)]


def test_keep_last_never_prunes_the_step_just_saved(tmp_path: Path) -> None:
    """Resuming from an earlier step into a run with newer steps: the new save must survive pruning."""
    root = tmp_path / "checkpoints"
    mgr = CheckpointManager(root, keep_last=1)
    _save(mgr, 20)
    saved = _save(mgr, 5)
    assert saved.is_dir() and mgr.latest() == saved


def test_resave_of_existing_step_replaces_it(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    mgr = CheckpointManager(root)
    _save(mgr, 3, engine=FakeEngine("old"))
    _save(mgr, 3, engine=FakeEngine("new"))
    assert (root / "step_00000003" / "shard.bin").read_bytes() == b"new" * 100
    assert mgr.latest() == root / "step_00000003"


def test_resolve_checkpoint_forms(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(run / "checkpoints")
    _save(mgr, 1)
    step2 = _save(mgr, 2)
    assert resolve_checkpoint(run) == step2  # run folder
    assert resolve_checkpoint(run / "checkpoints") == step2  # checkpoints folder
    assert resolve_checkpoint(str(run / "checkpoints")) == step2  # str works too
    step1 = run / "checkpoints" / "step_00000001"
    assert resolve_checkpoint(step1) == step1  # an explicit (older) step folder
    assert resolve_checkpoint(step2) == step2

    empty = tmp_path / "empty"
    empty.mkdir()
    not_ckpt = tmp_path / "notes.txt"
    not_ckpt.write_text("hello")
    for bad in (empty, tmp_path / "missing", not_ckpt):
        with pytest.raises(LoongError) as err:
            resolve_checkpoint(bad)
        msg = str(err.value)
        assert str(bad) in msg and "not a Loong checkpoint" in msg and "\n" not in msg

    # a step folder whose save never completed (no trainer_state.json) is not a checkpoint
    with pytest.raises(LoongError, match="not a Loong checkpoint"):
        resolve_checkpoint(_stale_tmp(run))


def _stale_tmp(run: Path) -> Path:
    stale = run / "checkpoints" / ".step_00000003.tmp"
    stale.mkdir()
    (stale / "shard.bin").write_bytes(b"partial")
    return stale


def test_dangling_latest_is_a_clear_error(tmp_path: Path) -> None:
    """``latest`` naming a missing step (e.g. deleted by hand) fails with one line, not a traceback later."""
    # (``latest`` is informational; what counts is a step directory with a valid manifest.)
    root = tmp_path / "run" / "checkpoints"
    _save(CheckpointManager(root), 4)
    for p in (root / "step_00000004").iterdir():
        p.unlink()
    (root / "step_00000004").rmdir()
    assert CheckpointManager(root).latest() is None
    with pytest.raises(LoongError) as err:
        resolve_checkpoint(tmp_path / "run")
    assert "not a Loong checkpoint" in str(err.value) and "\n" not in str(err.value)


def test_state_and_config_files_are_plain(tmp_path: Path) -> None:
    """trainer_state.json is JSON and config.yaml is YAML that round-trip the given dicts."""
    mgr = CheckpointManager(tmp_path)
    config = {"model": {"hidden_size": 64, "preset": "tiny"}, "train": {"steps": 10, "lr": 3e-3}}
    out = mgr.save(7, FakeEngine("x"), {"step": 7, "scheduler": {"num_steps": 7}}, config)
    assert json.loads((out / STATE_FILE).read_text()) == {"step": 7, "scheduler": {"num_steps": 7}}
    assert yaml.safe_load((out / CONFIG_FILE).read_text()) == config
    assert list(config) == list(read_config(out))  # order kept (sort_keys=False): readable diffs


# --- manifest and integrity ------------------------------------------------------------------------
def test_manifest_is_written_last_and_verifies(tmp_path: Path) -> None:
    from loong.core.checkpoint import MANIFEST, checkpoint_problem

    step = _save(CheckpointManager(tmp_path / "checkpoints"), 1)
    manifest = json.loads((step / MANIFEST).read_text())
    assert set(manifest["files"]) == {"shard.bin", ".metadata", STATE_FILE, CONFIG_FILE}
    assert manifest["files"]["shard.bin"]["size"] == len(b"step1") * 100
    assert checkpoint_problem(step) is None
    (step / "shard.bin").write_bytes(b"x" * 500)  # same size, other bytes
    assert "corrupted" in checkpoint_problem(step)
    assert checkpoint_problem(step, checksums=False) is None  # sizes alone cannot see it
    (step / "shard.bin").write_bytes(b"x")
    assert "truncated" in checkpoint_problem(step, checksums=False)


def test_broken_directories_do_not_count_towards_keep_last(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    mgr = CheckpointManager(root, keep_last=2)
    _save(mgr, 2)
    broken = _save(mgr, 4)
    (broken / "manifest.json").unlink()  # e.g. damaged by hand: not a checkpoint any more
    _save(mgr, 6)
    # keep_last=2 keeps the two newest *complete* ones (6 and 2); the broken one is left for a person.
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000006"]
    assert mgr.latest() == root / "step_00000006"
    (root / "step_00000006" / "shard.bin").write_bytes(b"")
    assert mgr.latest() == root / "step_00000002"  # newest that verifies


def test_rng_states_round_trip_without_unpickling(tmp_path: Path) -> None:
    import random

    import numpy as np
    import torch

    from loong.core.checkpoint import load_rng_states, save_rng_states

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_rng_states(tmp_path)
    want = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    assert load_rng_states(tmp_path) is None  # loads with torch.load(weights_only=True)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])
    assert "no RNG states" in load_rng_states(tmp_path / "elsewhere")
