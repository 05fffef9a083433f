"""Bad input fails fast and cleanly: exit code 2, one ``error: ...`` line naming the problem, nothing written.

Each case runs the real CLI in-process (``main([...])``) from an empty working directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from loong.core.testing import clean_failure_cli, unchanged, write_checkpoint_corpus
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
def cli(tmp_path: Path) -> Callable[..., str]:
    """``cli(*overrides)``: ``loong-llm train BASE ...`` (``train=False``: ``loong-llm ARGS``) from an empty cwd,
    the clean-failure contract asserted (``loong.core.testing.expect_clean_failure``); returns the error line."""
    run = clean_failure_cli(main, tmp_path, train=BASE)
    return lambda *args, train=True: run("train", *args) if train else run(*args)


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


@pytest.mark.parametrize("gbs,expected", [
    (6, "the interleaved pipeline (parallel.vpp=2) runs micro-batches in groups of parallel.pp=2; "
        "train.global_batch_size=6 / (train.micro_batch_size=2 x data-parallel size 1) = 3 micro-batches per step is "
        "not a multiple of 2; allowed: train.global_batch_size a multiple of 4, e.g. 4 or 8"),
    (2, "= 1 micro-batches per step is not a multiple of 2; allowed: train.global_batch_size a multiple of 4, e.g. 4"),
    (8, None),
])
def test_interleaved_pipeline_needs_whole_groups_of_micro_batches(gbs: int, expected: str | None) -> None:
    """megatron-core's interleaved schedule stopped in the first step on 3 micro-batches at pp=2 (a RuntimeError
    on "dependency bubbles"; seen on 2 gloo ranks). The engine refuses it before building the model; a unit test,
    as one process cannot lay out pp=2."""
    from loong.core.config import compose_config
    from loong.core.engines.megatron.engine import check_interleaved_microbatches
    from loong.core.errors import LoongError
    from loong.llm.schema import LLMRunConfig

    cfg, _ = compose_config("loong.llm.configs", "pretrain", ["parallel.pp=2", "parallel.vpp=2",
                                                               f"train.global_batch_size={gbs}",
                                                               "train.micro_batch_size=2"], LLMRunConfig)
    if expected is None:
        check_interleaved_microbatches(cfg, dp=1)
        return
    with pytest.raises(LoongError) as exc:
        check_interleaved_microbatches(cfg, dp=1)
    assert expected in str(exc.value), exc.value


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


# --- the corpus of issue 25: data files, tokenizer folders, HF folders, checkpoints, every verb ------------------
def _rewrite_hf(src: Path, dst: Path, config: dict | None = None, edit=None) -> Path:  # noqa: ANN001
    """A copy of the HF folder ``src`` with ``config`` merged into config.json and ``edit(tensors)`` applied."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    if edit is not None:
        tensors = load_file(src / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def corpus(tiny_llama_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The bad inputs of every kind, built once: data files, tokenizer folders, HF folders, checkpoints, plus a
    good preprocess output and a good HF export (what a failed run must leave byte for byte)."""
    import torch

    d = tmp_path_factory.mktemp("corpus")
    good = '{"text": "a fine document"}\n'
    (d / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)  # a PNG header
    (d / "latin1.jsonl").write_bytes((good + '{"text": "caf\u00e9 cr\u00e8me"}\n').encode("latin-1"))
    (d / "utf16.txt").write_bytes("one document\nanother\n".encode("utf-16"))
    (d / "truncated.jsonl").write_text(good * 2 + '{"text": "cut off in the mid')
    (d / "huge.jsonl").write_text(good + '{"text": "' + "x" * 2_000_000 + "\n")  # a 2 MB line, unterminated
    (d / "nofield.jsonl").write_text(good + '{"body": "the text is under another key"}\n')
    (d / "good.jsonl").write_text(good * 20)
    (d / "tok_empty").mkdir()
    (d / "tok_corrupt").mkdir()
    (d / "tok_corrupt" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    (d / "tok_corrupt" / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    hf = tiny_llama_hf
    _rewrite_hf(hf, d / "hf_broken_config").joinpath("config.json").write_text('{"architectures": ["Llama')
    _rewrite_hf(hf, d / "hf_missing", edit=lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    _rewrite_hf(hf, d / "hf_shape", edit=lambda t: t.update(
        {"model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 32)}))
    _rewrite_hf(hf, d / "hf_extra", edit=lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    _rewrite_hf(hf, d / "hf_dtype", edit=lambda t: t.update(
        {"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    _rewrite_hf(hf, d / "hf_mismatch", config={"intermediate_size": 256})  # the weights are 128 wide
    # a Loong checkpoint (HF -> Loong), its truncated and newer-format copies, and a checkpoint of another
    # modality (a diffusion run's config)
    assert main(["convert", str(hf), str(d / "ckpt")]) == 0
    write_checkpoint_corpus(d, base=d / "ckpt", config={"task": "diffusion", "engine": "fsdp",
                                                         "model": {"preset": "tiny", "patch_size": [1, 2, 2]}})
    assert main(["convert", str(d / "ckpt"), str(d / "hf_good")]) == 0
    assert main(["preprocess", str(d / "good.jsonl"), "--output-prefix", str(d / "pre" / "p"), "--workers", "1",
                 "--no-progress"]) == 0
    return d


PREPROCESS_CASES = [  # (input file, extra args, what the line must hold; "{f}": the input's path)
    ("binary.txt", [], "{f}:1: not valid UTF-8"),
    ("latin1.jsonl", [], "{f}:2: not valid UTF-8"),
    ("utf16.txt", [], "{f}:1: not valid UTF-8"),
    ("truncated.jsonl", [], "{f}:3: not valid JSON"),
    ("huge.jsonl", [], "{f}:2: not valid JSON"),
    ("nofield.jsonl", [], "{f}:2: no 'text' field (found ['body']); set --text-field"),
    ("good.jsonl", ["--tokenizer", "{d}/tok_empty"], "cannot load a tokenizer from {d}/tok_empty: no tokenizer files"),
    ("good.jsonl", ["--tokenizer", "{d}/tok_corrupt"], "cannot load a tokenizer from {d}/tok_corrupt"),
]  # fmt: skip


@pytest.mark.parametrize("name,extra,expected", PREPROCESS_CASES, ids=[f"{n}{' '.join(e)}" for n, e, _ in
                                                                        PREPROCESS_CASES])
def test_preprocess_bad_input(cli, corpus: Path, name: str, extra: list[str], expected: str) -> None:
    f = corpus / name
    args = [a.format(d=corpus) for a in extra]
    with unchanged(corpus / "pre"):  # a failed preprocess must leave the earlier output as it was
        msg = cli("preprocess", str(f), "--output-prefix", str(corpus / "pre" / "p"), "--workers", "1",
                  "--no-progress", *args, train=False)
    assert expected.format(f=f, d=corpus) in msg and len(msg) < 400, msg


def test_a_failed_preprocess_removes_the_folders_it_made(cli, corpus: Path) -> None:
    """``--output-prefix`` under folders that do not exist yet: they are made, and removed again on failure."""
    msg = cli("preprocess", str(corpus / "truncated.jsonl"), "--output-prefix", str(corpus / "new" / "sub" / "p"),
              "--workers", "1", "--no-progress", train=False)
    assert "truncated.jsonl:3: not valid JSON" in msg and not (corpus / "new").exists(), msg


def test_preprocess_skip_policy_counts_the_bad_lines(corpus: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    """``--on-error skip``: the documented policy for malformed records; the good ones are written."""
    rc = main(["preprocess", str(corpus / "nofield.jsonl"), str(corpus / "latin1.jsonl"), "--output-prefix",
               str(tmp_path / "p"), "--workers", "1", "--no-progress", "--on-error", "skip"])
    out = capsys.readouterr().out
    assert rc == 0 and "documents: 2\n" in out and "skipped: 2 (0 empty, 2 invalid)" in out, out


TRAIN_DATA_CASES = [  # (override, what the line must hold)
    ("data.path={d}/latin1.jsonl", "{d}/latin1.jsonl:2: not valid UTF-8"),
    ("data.path={d}/binary.txt", "{d}/binary.txt:1: not valid UTF-8"),
    ("data.path={d}/truncated.jsonl", "{d}/truncated.jsonl:3: not valid JSON"),
    ("data.path={d}/nofield.jsonl", "{d}/nofield.jsonl:2: no 'text' field (found ['body']); set data.text_field"),
    ("data.tokenizer={d}/tok_empty", "data.tokenizer: cannot load a tokenizer from {d}/tok_empty: no tokenizer files"),
    ("data.tokenizer={d}/tok_corrupt", "data.tokenizer: cannot load a tokenizer from {d}/tok_corrupt"),
]


@pytest.mark.parametrize("override,expected", TRAIN_DATA_CASES, ids=[o for o, _ in TRAIN_DATA_CASES])
def test_train_bad_data_or_tokenizer(cli, corpus: Path, override: str, expected: str) -> None:
    msg = cli(override.format(d=corpus))
    assert expected.format(d=corpus) in msg and len(msg) < 400, msg


HF_CASES = [  # (HF folder, what the line must hold)
    ("hf_broken_config", "{d}/hf_broken_config/config.json: not valid JSON"),
    ("hf_missing", "{d}/hf_missing: Hugging Face checkpoint has no tensor model.layers.2.mlp.up_proj.weight"),
    ("hf_shape", "{d}/hf_shape: model.layers.1.self_attn.o_proj.weight has shape (64, 32)"),
    ("hf_extra", "{d}/hf_extra: Hugging Face checkpoint has 1 tensors that a llama model with this config does not have, e.g. "
                 "['model.layers.0.self_attn.q_proj.bias']"),
    ("hf_dtype", "{d}/hf_dtype: model.norm.weight is torch.int32"),
    ("hf_mismatch", "{d}/hf_mismatch: "),
]


@pytest.mark.parametrize("name,expected", HF_CASES, ids=[n for n, _ in HF_CASES])
def test_convert_bad_hf_folder_keeps_the_existing_output(cli, corpus: Path, tmp_path: Path, name: str,
                                                         expected: str) -> None:
    with unchanged(tmp_path / "dst", copy_of=corpus / "ckpt") as dst:  # a good earlier conversion there
        msg = cli("convert", str(corpus / name), str(dst), train=False)
    assert expected.format(d=corpus) in msg, msg


@pytest.mark.parametrize("name", ["hf_missing", "hf_shape"])
def test_init_from_bad_hf_folder(cli, corpus: Path, name: str) -> None:
    msg = cli(f"model.init_from_hf={corpus / name}")
    assert f"{corpus / name}: " in msg and "model.layers." in msg, msg


CKPT_CASES = [  # (checkpoint, what the line must hold)
    ("truncated_ckpt", "bytes, the manifest says"),
    ("newer_ckpt", "checkpoint format 99; this Loong reads format 1"),
    ("foreign_ckpt", "is not a"),  # convert: "a loong-llm checkpoint"; train: "a checkpoint of this CLI's models"
]


@pytest.mark.parametrize("name,expected", CKPT_CASES, ids=[n for n, _ in CKPT_CASES])
@pytest.mark.parametrize("verb", ["convert", "train"])
def test_bad_checkpoint(cli, corpus: Path, tmp_path: Path, verb: str, name: str, expected: str) -> None:
    src = corpus / name
    if verb == "convert":
        with unchanged(tmp_path / "hf", copy_of=corpus / "hf_good") as dst:
            msg = cli("convert", str(src), str(dst), train=False)
    else:
        msg = cli(f"train.resume={src}")
    assert str(src) in msg and expected in msg, msg


def test_convert_another_architecture(cli, inputs: Path, tmp_path: Path) -> None:
    msg = cli("convert", str(inputs / "gpt2"), str(tmp_path / "dst"), train=False)
    assert "GPT2LMHeadModel" in msg and str(inputs / "gpt2") in msg
    assert not (tmp_path / "dst").exists()


def test_env_rejects_an_unknown_option(capsys: pytest.CaptureFixture) -> None:
    """``env`` takes no arguments but ``--json``: argparse's usage error, exit code 2, no traceback."""
    with pytest.raises(SystemExit) as exc:
        main(["env", "--jsn"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unrecognized arguments: --jsn" in err and "Traceback" not in err
