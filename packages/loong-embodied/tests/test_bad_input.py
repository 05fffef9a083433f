"""Bad input to ``loong-embodied`` fails fast and cleanly: exit code 2, one ``error: ...`` line naming the file or
key, no traceback, and nothing written (no output directory, nothing in the working directory, an existing output
folder left byte for byte). Each case runs the real CLI in-process (``main([...])``); the inputs are built once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from loong.core.testing import clean_failure_cli, unchanged, write_checkpoint_corpus
from loong.embodied.cli import main

TRAIN = ["train.steps=1", "train.progress=false", "run_name=r"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LeRobot policy folders, LeRobotDataset folders and checkpoints that are wrong in one way each."""
    d = tmp_path_factory.mktemp("embodied_corpus")
    for name, config in (("broken_config", '{"type": "pi05", '), ("other_type", '{"type": "act"}'),
                         ("truncated_weights", '{"type": "pi05"}')):
        (d / name).mkdir()
        (d / name / "config.json").write_text(config)
        (d / name / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\"")  # cut in its header
    (d / "not_a_dataset").mkdir()
    for name, info in (("broken_info", '{"codebase_version": "v3.0", '), ("v21", '{"codebase_version": "v2.1"}')):
        (d / name / "meta").mkdir(parents=True)
        (d / name / "meta" / "info.json").write_text(info)
    # foreign_ckpt: a loong-llm run's checkpoint (another modality's model section, no policy); its copies
    # newer_ckpt (manifest format 99) and truncated_ckpt (weights.bin cut to 128 of 256 bytes)
    write_checkpoint_corpus(d)
    (d / "good_out").mkdir()
    (d / "good_out" / "config.json").write_text('{"a": "good earlier export"}')
    return d


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., str]:
    """``cli(*argv)``: run ``loong-embodied`` from an empty cwd, assert the clean-failure contract, return the
    line."""
    return clean_failure_cli(main, tmp_path, train=TRAIN)


CONVERT_CASES = [  # (source, the text the line holds; {d}: the corpus folder)
    ("broken_config", "{d}/broken_config/config.json: not a LeRobot policy config"),
    ("other_type", "'act'"),
    ("truncated_weights", "{d}/truncated_weights/model.safetensors: cannot read safetensors file"),
    ("foreign_ckpt", "{d}/foreign_ckpt"),
    ("newer_ckpt", "checkpoint format 99; this Loong reads format 1"),
    ("truncated_ckpt", "weights.bin is 128 bytes, the manifest says 256 (truncated?)"),
]


@pytest.mark.parametrize("name,expected", CONVERT_CASES, ids=[n for n, _ in CONVERT_CASES])
def test_convert_bad_source_keeps_the_existing_output(cli, corpus: Path, tmp_path: Path, name: str,
                                                      expected: str) -> None:
    with unchanged(tmp_path / "dst", copy_of=corpus / "good_out") as dst:
        msg = cli("convert", str(corpus / name), str(dst))
    assert expected.format(d=corpus) in msg and str(corpus / name) in msg, msg


@pytest.mark.parametrize("verb,name,expected", [
    ("eval", "newer_ckpt", "checkpoint format 99; this Loong reads format 1"),
    ("serve", "truncated_ckpt", "weights.bin is 128 bytes, the manifest says 256 (truncated?)"),
])
def test_inference_verbs_refuse_a_bad_checkpoint(cli, corpus: Path, verb: str, name: str, expected: str) -> None:
    msg = cli(verb, str(corpus / name), "--device", "cpu")
    assert expected in msg and str(corpus / name) in msg, msg


TRAIN_CASES = [  # (override, the text the line holds)
    ("data.repo_root={d}/not_a_dataset", "{d}/not_a_dataset: not a LeRobotDataset folder (it has no meta/info.json)"),
    ("data.repo_root={d}/broken_info", "{d}/broken_info/meta/info.json: cannot be read as JSON"),
    ("data.repo_root={d}/v21", "{d}/v21/meta/info.json: codebase_version v2.1; Loong reads LeRobotDataset v3"),
    ("train.resume={d}/foreign_ckpt", "train.resume: {d}/foreign_ckpt/checkpoints/step_00000000 is not a checkpoint "
                                      "of this CLI's models"),
    ("model.init_from={d}/broken_config", "{d}/broken_config/config.json: not a LeRobot policy config"),
]


@pytest.mark.parametrize("override,expected", TRAIN_CASES, ids=[o.split("/")[-1] for o, _ in TRAIN_CASES])
def test_train_bad_input(cli, corpus: Path, override: str, expected: str) -> None:
    msg = cli("train", override.format(d=corpus))
    assert expected.format(d=corpus) in msg and len(msg) < 500, msg


@pytest.mark.parametrize("value,expected", [
    ("reach_c", "train.save_lerobot_dataset=reach_c: 'reach_c' names none of data.repo_root's datasets "
                "(0: not_a_dataset, 1: v21)"),
    ("2", "train.save_lerobot_dataset=2: 2 is not one of data.repo_root's 2 dataset(s) (0: not_a_dataset, 1: v21)"),
], ids=["name", "index"])
def test_train_save_lerobot_dataset_naming_no_dataset_of_the_mix(cli, corpus: Path, value: str,
                                                                  expected: str) -> None:
    """Checked before the datasets are read (these two folders are not even datasets) or anything is written."""
    msg = cli("train", f"data.repo_root=[{corpus}/not_a_dataset,{corpus}/v21]", "train.save_lerobot=true",
              f"train.save_lerobot_dataset={value}")
    assert expected in msg and len(msg) < 500, msg


@pytest.mark.parametrize("policy,processor_class,config_class", [
    ("pi05", "Pi05Processor", "Pi05Config"), ("groot_n1_7", "GrootN17Processor", "GrootN17Config"),
    ("groot_n1_6", "GrootN16Processor", "GrootN16Config")])
def test_a_broken_processor_file_is_named(tmp_path: Path, policy: str, processor_class: str,
                                          config_class: str) -> None:
    """A saved policy's processor file cut mid-write: one line naming it (was: a JSONDecodeError traceback)."""
    import importlib

    from loong.core.errors import LoongError

    processor = importlib.import_module(f"loong.embodied.policies.{policy}.processor")
    config = getattr(importlib.import_module(f"loong.embodied.policies.{policy}.config"), config_class)()
    (tmp_path / processor.PROCESSOR_FILE).write_text('{"state_dim": 2, ')
    with pytest.raises(LoongError, match=f"{tmp_path / processor.PROCESSOR_FILE}: not valid JSON"):
        getattr(processor, processor_class).load(tmp_path, config)


@pytest.mark.parametrize("text", ['{"sources": [{"root": "/d", ', '{"datasets": []}', '{"sources": [{"root": "/d"}]}'],
                         ids=["truncated", "no_sources_key", "entry_without_name"])
def test_a_broken_sources_file_is_named(tmp_path: Path, text: str) -> None:
    """A mix's ``sources.json`` cut mid-write or edited by hand: one line naming it (was: JSONDecodeError/KeyError)."""
    from loong.core.errors import LoongError
    from loong.embodied.data.normalize import SOURCES_FILE, read_sources, write_sources

    write_sources(tmp_path, [{"root": "/d", "name": "d", "embodiment_id": 0}])
    assert read_sources(tmp_path) == [{"root": "/d", "name": "d", "embodiment_id": 0}]
    (tmp_path / SOURCES_FILE).write_text(text)
    with pytest.raises(LoongError, match=f"{tmp_path / SOURCES_FILE}: "):
        read_sources(tmp_path)
