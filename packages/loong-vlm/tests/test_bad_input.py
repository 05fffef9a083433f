"""Bad input to ``loong-vlm`` fails fast and cleanly: exit code 2, one ``error: ...`` line naming the file, line or
key, no traceback, and nothing written (no output directory, nothing in the working directory, an existing output
folder left byte for byte). Each case runs the real CLI in-process (``main([...])``); the inputs are built once."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from loong.core.testing import clean_failure_cli, unchanged, write_checkpoint_corpus
from loong.vlm.cli import main

TRAIN = ["train.steps=2", "train.progress=false", "run_name=r", "data.synthetic_size=8", "train.global_batch_size=2",
         "train.micro_batch_size=2", "train.seq_length=128"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Conversation files, HF folders and checkpoints that are wrong in one way each."""
    from transformers import LlamaConfig, LlamaForCausalLM

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
    # foreign_ckpt: a loong-llm run's checkpoint (a model section, no encoder / projector / foundation); its copies
    # newer_ckpt (manifest format 99) and truncated_ckpt (weights.bin cut to 128 of 256 bytes)
    write_checkpoint_corpus(d)
    (d / "good_out").mkdir()
    (d / "good_out" / "config.json").write_text('{"a": "good earlier export"}')
    return d


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., str]:
    """``cli(*argv)``: run ``loong-vlm`` from an empty cwd, assert the clean-failure contract, return the line."""
    # the one thing allowed in output_dir: the tiny processor's content-addressed cache (output_dir/.cache, shared by
    # runs), which the data is read with; no run directory, no checkpoint
    return clean_failure_cli(main, tmp_path, train=TRAIN, out_may_hold=[".cache"])


TRAIN_CASES = [  # (override, the text the line holds; {d}: the corpus folder)
    ("data.path={d}/empty.jsonl", "data.path: {d}/empty.jsonl holds no usable conversation (0 lines read)"),
    ("data.path={d}/binary.jsonl", "{d}/binary.jsonl:1: not valid UTF-8"),
    ("data.path={d}/latin1.jsonl", "{d}/latin1.jsonl:2: not valid UTF-8"),
    ("data.path={d}/truncated.jsonl", "{d}/truncated.jsonl:3: not valid JSON"),
    ("data.path={d}/nofield.jsonl", "{d}/nofield.jsonl:2: "),
    ("data.processor={d}/noprocessor", "{d}/noprocessor"),
    ("train.resume={d}/foreign_ckpt", "train.resume: {d}/foreign_ckpt/checkpoints/step_00000000 is not a checkpoint "
                                      "of this CLI's models"),
    ("train.resume={d}/newer_ckpt", "checkpoint format 99; this Loong reads format 1"),
    ("train.resume={d}/truncated_ckpt", "weights.bin is 128 bytes, the manifest says 256 (truncated?)"),
    # several overrides, space-separated: rows that do not split over TP under sequence parallelism (megatron
    # stopped in the first forward on a bare assertion), asked for and implied by a MoE foundation at tp > 1
    ("parallel.tp=2 parallel.sequence_parallel=true train.seq_length=129",
     "train.seq_length=129 must divide by parallel.tp=2 under sequence parallelism"),
    ("model=tiny_qwen3_vl_moe parallel.tp=2 train.seq_length=129",
     "train.seq_length=129 must divide by parallel.tp=2 under sequence parallelism"),
]


@pytest.mark.parametrize("override,expected", TRAIN_CASES, ids=[o.split("/")[-1] for o, _ in TRAIN_CASES])
def test_train_bad_input(cli, corpus: Path, override: str, expected: str) -> None:
    msg = cli("train", *override.format(d=corpus).split())
    assert expected.format(d=corpus) in msg and len(msg) < 500, msg


CONVERT_CASES = [  # (source, the text the line holds)
    ("llama", "LlamaForCausalLM"),
    ("broken_config", "{d}/broken_config/config.json: not valid JSON"),
    ("foreign_ckpt", "{d}/foreign_ckpt/checkpoints/step_00000000 is not a loong-vlm checkpoint (its config has no "
                     "encoder, projector, foundation section)"),
    ("newer_ckpt", "checkpoint format 99; this Loong reads format 1"),
    ("truncated_ckpt", "weights.bin is 128 bytes, the manifest says 256 (truncated?)"),
]


@pytest.mark.parametrize("name,expected", CONVERT_CASES, ids=[n for n, _ in CONVERT_CASES])
def test_convert_bad_source_keeps_the_existing_output(cli, corpus: Path, tmp_path: Path, name: str,
                                                      expected: str) -> None:
    with unchanged(tmp_path / "dst", copy_of=corpus / "good_out") as dst:
        msg = cli("convert", str(corpus / name), str(dst))
    assert expected.format(d=corpus) in msg and str(corpus / name) in msg, msg
