"""The run directory rule (``loong.core.run_dir``): the same command finds the same directory, keys marked
``KEEPS_RUN`` keep it, any other change is another run that says how it differs. The end-to-end test (a SIGKILL of
``loong-llm train`` and a rerun of the identical command) is ``packages/loong-llm/tests/test_rerun.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from loong.core.config import RunConfig, from_dict, to_dict
from loong.core.run_dir import identity, new_run_note, run_directory, run_id


def _cfg(**sections: dict) -> RunConfig:
    return from_dict(RunConfig, sections)


def _dir(cfg: RunConfig) -> Path:
    return run_directory(cfg, to_dict(cfg))


def test_the_same_config_gives_the_same_directory_and_keeps_run_keys_keep_it(tmp_path: Path) -> None:
    base = {"output_dir": str(tmp_path), "train": {"lr": 1e-3}}
    first = _dir(_cfg(**base))
    assert first.parent == tmp_path and first.name.startswith("run-") and len(first.name) == len("run-") + 10
    assert _dir(_cfg(**base)) == first
    kept = {"steps": 5000, "log_interval": 7, "eval_interval": 0, "save_interval": 3, "keep_last": 0,
            "progress": False, "on_nonfinite": "skip", "time_limit_s": 60.0, "profile_steps": [2, 3],
            "resume": "auto", "async_save": True}
    assert _dir(_cfg(**{**base, "train": {**base["train"], **kept}})) == first
    for changed in ({"train": {"lr": 2e-3}}, {"train": {"lr": 1e-3, "seed": 7}}, {"train": {"lr": 1e-3},
                    "parallel": {"tp": 2}}, {"train": {"lr": 1e-3}, "data": {"path": "corpus.jsonl"}}):
        assert _dir(_cfg(output_dir=str(tmp_path), **changed)) != first, changed


def test_a_key_added_with_its_default_does_not_move_existing_runs() -> None:
    @dataclasses.dataclass
    class Later(RunConfig):
        new_key: int = 3

    plain = to_dict(_cfg(train={"lr": 1e-3}))
    assert run_id({**plain, "new_key": 3}, Later) == run_id(plain, RunConfig)
    assert run_id({**plain, "new_key": 4}, Later) != run_id(plain, RunConfig)
    assert identity(plain, RunConfig) == {"train.lr": 1e-3}  # defaults and KEEPS_RUN keys are left out


def test_run_name_is_kept_and_resume_none_gets_a_new_timestamped_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _dir(_cfg(output_dir=str(tmp_path), run_name="mine")) == tmp_path / "mine"
    monkeypatch.setenv("LOONG_RUN_STAMP", "20300101-000000")
    assert _dir(_cfg(output_dir=str(tmp_path), train={"resume": "none"})) == tmp_path / "run-20300101-000000"
    assert _dir(_cfg(output_dir=str(tmp_path), run_name="mine", train={"resume": "none"})) == tmp_path / "mine"


def _fake_run(root: Path, cfg: RunConfig) -> Path:
    """A run directory whose latest checkpoint holds ``cfg``'s resolved config (what new_run_note reads)."""
    run = _dir(cfg)
    step = run / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    return run


def test_a_changed_config_names_the_keys_that_differ_from_the_newest_earlier_run(tmp_path: Path) -> None:
    old = _cfg(output_dir=str(tmp_path), train={"lr": 3e-3, "steps": 10})
    new = _cfg(output_dir=str(tmp_path), train={"lr": 1e-2, "steps": 20}, parallel={"cp": 2})
    assert new_run_note(new, to_dict(new), _dir(new)) is None  # no earlier run
    earlier = _fake_run(tmp_path, old)
    note = new_run_note(new, to_dict(new), _dir(new))
    assert note == (f"new run {_dir(new).name}: the config differs from the newest earlier run {earlier.name} in "
                    f"parallel.cp (1 -> 2), train.lr (0.003 -> 0.01); to continue that run with this config instead, "
                    f"pass run_name={earlier.name}")
    assert "train.steps" not in note  # a KEEPS_RUN key
    named = _cfg(output_dir=str(tmp_path), run_name="other", train={"lr": 1e-2})
    assert new_run_note(named, to_dict(named), _dir(named)) is None  # a name given: the user chose the directory


class _Engine:
    """CheckpointManager only calls ``engine.save(directory)``; outside a process group its barriers are no-ops."""

    def save(self, directory: Path) -> None:
        (Path(directory) / "shard.bin").write_bytes(b"weights")


def _checkpoint(checkpoints: Path, step: int, weights_only: bool = False) -> Path:
    from loong.core.checkpoint import CheckpointManager

    state = {"step": step, **({"weights_only": True} if weights_only else {})}
    return CheckpointManager(checkpoints).save(step, _Engine(), state, {"train": {}})


def test_which_checkpoint_a_rerun_continues_from(tmp_path: Path) -> None:
    from loong.core.errors import LoongError
    from loong.core.run import _find_resume, _finished

    converted = _checkpoint(tmp_path / "converted", 0, weights_only=True)  # `convert`'s output: a starting point
    other = _checkpoint(tmp_path / "other" / "checkpoints", 10)
    cfg = _cfg(output_dir=str(tmp_path / "out"), train={"resume": str(converted), "steps": 10})
    run = _dir(cfg)
    notes: list[str] = []
    assert _find_resume(cfg, run, notes.append) == converted  # the first launch starts from the converted weights
    own = _checkpoint(run / "checkpoints", 4)
    assert _find_resume(cfg, run, notes.append) == own  # the rerun continues the run's own checkpoint
    assert notes == [f"train.resume={converted} started this run; continuing its own newest checkpoint"]
    assert _finished(cfg, run, own) is None and _finished(cfg, run, converted) is None
    full = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=str(other)))
    assert _find_resume(full, run, notes.append) == other  # a full checkpoint named explicitly wins
    with pytest.raises(LoongError, match=r"already at step 10 >= train.steps=10; raise train.steps"):
        _finished(full, run, other)  # another run's checkpoint with nothing left: an error, not "finished"
    done = _checkpoint(run / "checkpoints", 10)
    auto = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume="auto"))
    assert _find_resume(auto, run, notes.append) == done and _finished(auto, run, done) == 10  # finished: exit 0
    fresh = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume="none"))
    assert _find_resume(fresh, run, notes.append) is None
