"""Bad input fails fast and cleanly: exit code 2, one ``error: ...`` line naming the problem, nothing written.

Each case runs the real CLI in-process (``main([...])``) from an empty working directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loong.llm.cli import main

BASE = ["train.steps=2", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
        "train.progress=false", "run_name=r"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bad data files and a (real, tiny) GPT-2 folder, outside the working directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path_factory.mktemp("bad_inputs")
    (d / "empty.txt").write_text("")
    (d / "blank.jsonl").write_text("\n\n  \n")
    (d / "broken.jsonl").write_text(
        '{"text": "first document"}\n{"text": "second document"}\n{"text": oops}\n{"text": "fourth"}\n'
    )
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512, n_positions=64,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(d / "gpt2")
    (d / "emptydir").mkdir()
    return d


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """Run ``loong-llm ARGS`` from an empty cwd; assert the clean-failure contract; return the message."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "out"

    def run(*args: str, train: bool = True) -> str:
        capsys.readouterr()
        argv = ["train", *BASE, f"output_dir={out}", *args] if train else list(args)
        rc = main(argv)
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert rc == 2, (rc, captured.err[-3000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), captured.err[-3000:]
        assert "Traceback" not in captured.err and captured.out == ""
        assert not out.exists(), "a failed run must not create its output directory"
        assert list(cwd.iterdir()) == [], "a failed run must not write into the working directory"
        return lines[0]

    return run


def test_unknown_preset(cli) -> None:
    msg = cli("model=llama9")
    assert "unknown" in msg and "'llama9'" in msg
    # the closest presets are named (a did-you-mean and the list of llama presets)
    assert "did you mean 'llama" in msg and "llama2_7b" in msg and "tiny" in msg


def test_misspelt_key(cli) -> None:
    msg = cli("train.stesp=3")
    assert "'train.stesp'" in msg and "did you mean 'train.steps'" in msg


def test_misspelt_nested_key(cli) -> None:
    msg = cli("model.hiden_size=64")
    assert "model.hiden_size" in msg and "model.hidden_size" in msg


def test_wrong_value_type(cli) -> None:
    msg = cli("train.steps=abc")
    assert "train.steps" in msg and "integer" in msg and "abc" in msg


def test_wrong_literal_value(cli) -> None:
    msg = cli("train.precision=fp64")
    assert "train.precision" in msg and "fp64" in msg and "bf16" in msg


def test_missing_data_file(cli, inputs: Path) -> None:
    missing = inputs / "nope.txt"
    msg = cli(f"data.path={missing}")
    assert "data.path" in msg and str(missing) in msg and "does not exist" in msg


@pytest.mark.parametrize("name", ["empty.txt", "blank.jsonl"])
def test_empty_corpus(cli, inputs: Path, name: str) -> None:
    msg = cli(f"data.path={inputs / name}")
    assert str(inputs / name) in msg and "empty" in msg


def test_broken_jsonl_line(cli, inputs: Path) -> None:
    msg = cli(f"data.path={inputs / 'broken.jsonl'}")
    assert f"{inputs / 'broken.jsonl'}:3:" in msg and "JSON" in msg


def test_seq_length_above_model_max(cli) -> None:
    msg = cli("train.seq_length=4096")  # the tiny preset allows 1024 positions
    assert "train.seq_length=4096" in msg and "1024" in msg


def test_tp_not_dividing_heads(cli) -> None:
    msg = cli("model.num_attention_heads=3", "model.num_query_groups=3", "model.hidden_size=96",
              "parallel.tp=2")
    assert "tp=2" in msg and "3 attention heads" in msg


def test_expert_parallel_on_a_dense_model(cli) -> None:
    msg = cli("parallel.ep=2")
    assert "parallel.ep=2" in msg and "experts" in msg


def test_layout_larger_than_the_world(cli) -> None:
    msg = cli("parallel.tp=2")  # one process: tp=2 cannot be laid out
    assert "world size 1" in msg and "tp" in msg


def test_init_from_unsupported_hf_architecture(cli, inputs: Path) -> None:
    msg = cli(f"model.init_from_hf={inputs / 'gpt2'}")
    assert "GPT2LMHeadModel" in msg and str(inputs / "gpt2") in msg and "LlamaForCausalLM" in msg


def test_resume_from_non_checkpoint(cli, inputs: Path) -> None:
    msg = cli(f"train.resume={inputs / 'emptydir'}")
    assert str(inputs / "emptydir") in msg and "not a Loong checkpoint" in msg


def test_convert_unknown_source(cli, inputs: Path, tmp_path: Path) -> None:
    dst = tmp_path / "converted"
    msg = cli("convert", str(inputs / "emptydir"), str(dst), train=False)
    assert str(inputs / "emptydir") in msg and "nor a Loong checkpoint" in msg and "config.json" in msg
    assert not dst.exists()


def test_convert_missing_source(cli, tmp_path: Path) -> None:
    dst = tmp_path / "converted"
    msg = cli("convert", str(tmp_path / "nothing"), str(dst), train=False)
    assert "does not exist" in msg
    assert not dst.exists()
