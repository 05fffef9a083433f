"""Bad input to ``loong-vlm`` fails fast and cleanly: exit code 2, one ``error: ...`` line naming the file, line or
key, no traceback, and nothing written (no output directory, nothing in the working directory, an existing output
folder left byte for byte). Each case runs the real CLI in-process (``main([...])``); the inputs are built once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loong.vlm.cli import main

TRAIN = ["train.steps=2", "train.progress=false", "run_name=r", "data.synthetic_size=8", "train.global_batch_size=2",
         "train.micro_batch_size=2", "train.seq_length=128"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Conversation files, HF folders and checkpoints that are wrong in one way each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loong.core.checkpoint import CheckpointManager

    d = tmp_path_factory.mktemp("vlm_corpus")
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    line = json.dumps(good) + "\n"
    (d / "empty.jsonl").write_text("")
    (d / "binary.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (d / "latin1.jsonl").write_bytes((line + json.dumps(good, ensure_ascii=False).replace("hi", "caf\u00e9") + "\n")
                                     .encode("latin-1"))
    (d / "truncated.jsonl").write_text(line * 2 + line[:25])
    (d / "nofield.jsonl").write_text(line + json.dumps({"conversation": good["messages"]}) + "\n")
    (d / "noprocessor").mkdir()
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=128)).save_pretrained(d / "llama")
    shutil.copytree(d / "llama", d / "broken_config")
    (d / "broken_config" / "config.json").write_text('{"architectures": ["Qwen2_5_VLForConditionalGeneration"], ')

    class Weights:  # the slice of an engine the checkpoint manager needs
        def save(self, directory: Path) -> None:
            (directory / "weights.bin").write_bytes(b"\0" * 256)

    # a loong-llm run's checkpoint (a model section, no encoder / projector / foundation)
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
    """``cli(*argv)``: run ``loong-vlm`` from an empty cwd, assert the clean-failure contract, return the line."""
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
        # the one thing allowed: the tiny processor's content-addressed cache (output_dir/.cache, shared by runs),
        # which the data is read with; no run directory, no checkpoint
        assert not out.exists() or [p.name for p in out.iterdir()] == [".cache"], list(out.iterdir())
        assert list(cwd.iterdir()) == [], "a failed command must not write into the working directory"
        return lines[0]

    return run


TRAIN_CASES = [  # (override, the text the line holds; {d}: the corpus folder)
    ("data.path={d}/empty.jsonl", "data.path: {d}/empty.jsonl holds no usable conversation (0 lines read)"),
    ("data.path={d}/binary.jsonl", "{d}/binary.jsonl:1: not valid UTF-8"),
    ("data.path={d}/latin1.jsonl", "{d}/latin1.jsonl:2: not valid UTF-8"),
    ("data.path={d}/truncated.jsonl", "{d}/truncated.jsonl:3: not valid JSON"),
    ("data.path={d}/nofield.jsonl", "{d}/nofield.jsonl:2: "),
    ("data.processor={d}/noprocessor", "{d}/noprocessor"),
    ("train.resume={d}/llm_ckpt", "train.resume: {d}/llm_ckpt/checkpoints/step_00000000 is not a checkpoint of this "
                                  "CLI's models"),
    ("train.resume={d}/newer", "checkpoint format 2; this Loong reads format 1"),
    ("train.resume={d}/truncated_ckpt", "weights.bin is 100 bytes, the manifest says 256 (truncated?)"),
]


@pytest.mark.parametrize("override,expected", TRAIN_CASES, ids=[o.split("/")[-1] for o, _ in TRAIN_CASES])
def test_train_bad_input(cli, corpus: Path, override: str, expected: str) -> None:
    msg = cli("train", override.format(d=corpus))
    assert expected.format(d=corpus) in msg and len(msg) < 500, msg


CONVERT_CASES = [  # (source, the text the line holds)
    ("llama", "LlamaForCausalLM"),
    ("broken_config", "{d}/broken_config/config.json: not valid JSON"),
    ("llm_ckpt", "{d}/llm_ckpt/checkpoints/step_00000000 is not a loong-vlm checkpoint (its config has no encoder, "
                 "projector, foundation section)"),
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
