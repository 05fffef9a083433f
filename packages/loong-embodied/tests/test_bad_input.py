"""Bad input to ``loong-embodied`` fails fast and cleanly: exit code 2, one ``error: ...`` line naming the file or
key, no traceback, and nothing written (no output directory, nothing in the working directory, an existing output
folder left byte for byte). Each case runs the real CLI in-process (``main([...])``); the inputs are built once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loong.embodied.cli import main

TRAIN = ["train.steps=1", "train.progress=false", "run_name=r"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LeRobot policy folders, LeRobotDataset folders and checkpoints that are wrong in one way each."""
    from loong.core.checkpoint import CheckpointManager

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

    class Weights:  # the slice of an engine the checkpoint manager needs
        def save(self, directory: Path) -> None:
            (directory / "weights.bin").write_bytes(b"\0" * 256)

    # a loong-llm run's checkpoint: another modality's model section, no policy
    CheckpointManager(d / "llm_ckpt" / "checkpoints").save(
        0, Weights(), {"step": 0, "weights_only": True},
        {"task": "pretrain", "model": {"family": "llama", "num_layers": 2, "hidden_size": 64}})
    step = "checkpoints/step_00000000"
    shutil.copytree(d / "llm_ckpt", d / "newer")
    manifest = d / "newer" / step / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": 2}))
    shutil.copytree(d / "llm_ckpt", d / "truncated_ckpt")
    (d / "truncated_ckpt" / step / "weights.bin").write_bytes(b"\0" * 100)
    (d / "good_out").mkdir()
    (d / "good_out" / "config.json").write_text('{"a": "good earlier export"}')
    return d


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """``cli(*argv)``: run ``loong-embodied`` from an empty cwd, assert the clean-failure contract, return the
    line."""
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def run(*argv: str) -> str:
        capsys.readouterr()
        if argv[0] == "train":
            argv = ("train", *TRAIN, f"output_dir={out}", *argv[1:])
        rc = main(list(argv))
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert rc == 2, (rc, captured.err[-3000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), captured.err[-3000:]
        assert "Traceback" not in captured.err and captured.out == ""
        assert not out.exists() and list(cwd.iterdir()) == [], "a failed command must write nothing"
        return lines[0]

    return run


CONVERT_CASES = [  # (source, the text the line holds; {d}: the corpus folder)
    ("broken_config", "{d}/broken_config/config.json: not a LeRobot policy config"),
    ("other_type", "'act'"),
    ("truncated_weights", "{d}/truncated_weights/model.safetensors: cannot read safetensors file"),
    ("llm_ckpt", "{d}/llm_ckpt"),
    ("newer", "checkpoint format 2; this Loong reads format 1"),
    ("truncated_ckpt", "weights.bin is 100 bytes, the manifest says 256 (truncated?)"),
]


@pytest.mark.parametrize("name,expected", CONVERT_CASES, ids=[n for n, _ in CONVERT_CASES])
def test_convert_bad_source_keeps_the_existing_output(cli, corpus: Path, tmp_path: Path, name: str,
                                                      expected: str) -> None:
    dst = tmp_path / "dst"
    shutil.copytree(corpus / "good_out", dst)
    msg = cli("convert", str(corpus / name), str(dst))
    assert expected.format(d=corpus) in msg and str(corpus / name) in msg, msg
    assert _snapshot(dst) == _snapshot(corpus / "good_out"), "a failed conversion must not touch the existing output"


@pytest.mark.parametrize("verb,name,expected", [
    ("eval", "newer", "checkpoint format 2; this Loong reads format 1"),
    ("serve", "truncated_ckpt", "weights.bin is 100 bytes, the manifest says 256 (truncated?)"),
])
def test_inference_verbs_refuse_a_bad_checkpoint(cli, corpus: Path, verb: str, name: str, expected: str) -> None:
    msg = cli(verb, str(corpus / name), "--device", "cpu")
    assert expected in msg and str(corpus / name) in msg, msg


TRAIN_CASES = [  # (override, the text the line holds)
    ("data.repo_root={d}/not_a_dataset", "{d}/not_a_dataset: not a LeRobotDataset folder (it has no meta/info.json)"),
    ("data.repo_root={d}/broken_info", "{d}/broken_info/meta/info.json: cannot be read as JSON"),
    ("data.repo_root={d}/v21", "{d}/v21/meta/info.json: codebase_version v2.1; Loong reads LeRobotDataset v3"),
    ("train.resume={d}/llm_ckpt", "train.resume: {d}/llm_ckpt/checkpoints/step_00000000 is not a checkpoint of this "
                                  "CLI's models"),
    ("model.init_from={d}/broken_config", "{d}/broken_config/config.json: not a LeRobot policy config"),
]


@pytest.mark.parametrize("override,expected", TRAIN_CASES, ids=[o.split("/")[-1] for o, _ in TRAIN_CASES])
def test_train_bad_input(cli, corpus: Path, override: str, expected: str) -> None:
    msg = cli("train", override.format(d=corpus))
    assert expected.format(d=corpus) in msg and len(msg) < 500, msg
