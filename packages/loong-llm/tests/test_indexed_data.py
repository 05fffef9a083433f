"""Pretraining from preprocessed shards through megatron-core's GPTDataset / BlendedDataset.

Two corpora with disjoint alphabets (``a``-``m`` and ``n``-``z``) make every sample's corpus visible
from its token ids, so blend fractions can be counted. The end-to-end runs check that a run resumed
from its step-3 checkpoint logs the same losses as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loong.core.errors import LoongError
from loong.llm.data.indexed import (
    IndexedSamples,
    build_datasets,
    check_tokenizer,
    indexed_blend,
    parse_blend,
)
from loong.llm.data.preprocess import preprocess
from loong.llm.data.tokenizer import Tokenizer, build_packaged_tokenizer

SEQ = 32


def _words(rng: random.Random, letters: str, n: int) -> str:
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(n))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_packaged_tokenizer()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Corpus A (text, letters a-m) and corpus B (JSONL, letters n-z), 300 documents each."""
    d = tmp_path_factory.mktemp("shards")
    rng = random.Random(0)
    (d / "a.txt").write_text("\n".join(_words(rng, "abcdefghijklm", rng.randint(20, 80)) for _ in range(300)))
    (d / "b.jsonl").write_text("\n".join(json.dumps({"text": _words(rng, "nopqrstuvwxyz", rng.randint(20, 80))})
                                         for _ in range(300)))
    preprocess([d / "a.txt"], d / "a", progress=False)
    preprocess([d / "b.jsonl"], d / "b", progress=False)
    ids = {k: set(np.fromfile(d / f"{k}.bin", dtype=np.uint16).tolist()) for k in "ab"}
    return {"dir": d, "a": str(d / "a"), "b": str(d / "b"), "only_a": ids["a"] - ids["b"], "only_b": ids["b"] - ids["a"]}


def _corpus(window: np.ndarray, shards: dict) -> str:
    a = sum(int(t) in shards["only_a"] for t in window)
    b = sum(int(t) in shards["only_b"] for t in window)
    assert a != b, window
    return "a" if a > b else "b"


def _build(shards: dict, tok: Tokenizer, weights: list | None, seed: int = 1234, n: int = 1000,
           cache: Path | None = None, split: str = "969,30,1") -> tuple[IndexedSamples, IndexedSamples]:
    paths = None if weights is None else [weights[0], shards["a"], weights[1], shards["b"]]
    blend = parse_blend(shards["a"] if weights is None else None, paths)
    return build_datasets(blend, tok, SEQ, seed, split, train_samples=n, valid_samples=8,
                          cache=str(cache or shards["dir"] / "cache"))


# --- the blend config ------------------------------------------------------------------------
@pytest.mark.parametrize(("paths", "message"), [
    ([0.7, "a", 0.3], r"expected \[weight, prefix, weight, prefix, \.\.\.\] pairs, got 3 items"),
    ([], "got 0 items"),
    (["a", "b"], r"data.paths\[0\]: weight 'a' is not a number"),
    ([0.5, "a", "heavy", "b"], r"data.paths\[2\]: weight 'heavy' is not a number"),
    ([0.5, "a", -1, "b"], r"data.paths\[2\]: weight must be a positive number, got -1"),
    ([0.5, "a", 0.5, 7], r"data.paths\[3\]: expected a shard prefix, got 7"),
])
def test_bad_blends(paths: list, message: str) -> None:
    with pytest.raises(LoongError, match=message):
        parse_blend(None, paths)


def test_blend_parsing_and_missing_files(shards: dict) -> None:
    blend = parse_blend(None, ["0.7", shards["a"] + ".bin", 3, shards["b"]])
    assert blend.prefixes == [shards["a"], shards["b"]] and blend.weights == [0.7, 3.0]
    with pytest.raises(LoongError, match="both set"):
        parse_blend(shards["a"], [1, shards["b"]])
    assert indexed_blend(SimpleNamespace(path=None, paths=None)) is None
    assert indexed_blend(SimpleNamespace(path=str(shards["dir"] / "a.txt"), paths=None)) is None  # a text file
    assert indexed_blend(SimpleNamespace(path=shards["a"], paths=None)).prefixes == [shards["a"]]
    partial = shards["dir"] / "half"
    shutil.copy(shards["a"] + ".bin", str(partial) + ".bin")
    with pytest.raises(LoongError, match=rf"data.path: {partial}: missing {partial}\.idx"):
        indexed_blend(SimpleNamespace(path=str(partial), paths=None))
    with pytest.raises(LoongError, match=r"data.paths: .*nowhere: missing .*nowhere\.bin and .*nowhere\.idx"):
        indexed_blend(SimpleNamespace(path=None, paths=[1, shards["a"], 1, str(shards["dir"] / "nowhere")]))


def test_tokenizer_and_vocab_checks(shards: dict, tok: Tokenizer, tmp_path: Path) -> None:
    blend = parse_blend(None, [1, shards["a"], 1, shards["b"]])
    check_tokenizer(blend, tok, model_vocab=512)
    with pytest.raises(LoongError, match=r"holds token id \d+, but model.vocab_size is 100"):
        check_tokenizer(blend, tok, model_vocab=100)
    other = tmp_path / "other"
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(shards["b"] + ext, str(other) + ext)
    meta = json.loads(Path(str(other) + ".json").read_text())
    Path(str(other) + ".json").write_text(json.dumps({**meta, "tokenizer": "/models/llama", "vocab_size": 128256}))
    with pytest.raises(LoongError, match=r"was preprocessed with tokenizer /models/llama \(128256 tokens\), "
                                         r"but this run uses packaged \(512 tokens\)"):
        check_tokenizer(parse_blend(None, [1, str(other)]), tok, model_vocab=512)
    Path(str(other) + ".json").unlink()  # shards from other tools: the ids are scanned instead
    check_tokenizer(parse_blend(None, [1, str(other)]), tok, model_vocab=512)
    with pytest.raises(LoongError, match="holds token id"):
        check_tokenizer(parse_blend(None, [1, str(other)]), tok, model_vocab=64)


def test_bad_split(shards: dict, tok: Tokenizer) -> None:
    for split in ("abc", "0,1,0", "1,2,3,4", "-1,1"):
        with pytest.raises(LoongError, match="data.split: expected"):
            _build(shards, tok, None, split=split)


# --- samples ---------------------------------------------------------------------------------
def test_windows_single_prefix(shards: dict, tok: Tokenizer) -> None:
    train, valid = _build(shards, tok, None, n=200)
    assert train.shuffled and len(train) >= 200 and 8 <= len(valid) < len(train)
    window = train[0]
    assert window.shape == (SEQ + 1,) and window.dtype == np.int64
    assert {_corpus(train[i], shards) for i in range(50)} == {"a"}
    stream = np.fromfile(shards["a"] + ".bin", dtype=np.uint16)
    doc = window[: int(np.argmax(window == tok.eod_id))]  # a window's text is a piece of the corpus
    assert len(doc) == 0 or any(np.array_equal(stream[i:i + len(doc)], doc) for i in np.flatnonzero(stream == doc[0]))


def test_blend_fractions_follow_the_weights(shards: dict, tok: Tokenizer) -> None:
    train, valid = _build(shards, tok, [0.7, 0.3], n=1000)
    assert len(train) >= 1000
    counts = [_corpus(train[i], shards) for i in range(1000)]
    assert counts.count("a") / 1000 == pytest.approx(0.7, abs=0.02)
    first = [_corpus(train[i], shards) for i in range(100)]  # interleaved, not one corpus after the other
    assert first.count("a") / 100 == pytest.approx(0.7, abs=0.05)
    assert {_corpus(valid[i], shards) for i in range(len(valid))} == {"a", "b"}


def test_order_is_deterministic_from_the_seed(shards: dict, tok: Tokenizer, tmp_path: Path) -> None:
    def first(ds: IndexedSamples) -> np.ndarray:
        return np.stack([ds[i] for i in range(40)])

    ref = first(_build(shards, tok, [0.7, 0.3], seed=7, cache=tmp_path / "c1")[0])
    assert np.array_equal(ref, first(_build(shards, tok, [0.7, 0.3], seed=7, cache=tmp_path / "c1")[0]))  # cached
    assert np.array_equal(ref, first(_build(shards, tok, [0.7, 0.3], seed=7, cache=tmp_path / "c2")[0]))  # rebuilt
    assert not np.array_equal(ref, first(_build(shards, tok, [0.7, 0.3], seed=8, cache=tmp_path / "c1")[0]))


def test_empty_valid_split_and_too_small_train_split(shards: dict, tok: Tokenizer) -> None:
    _, valid = _build(shards, tok, None, split="1,0,0")
    assert len(valid) == 0
    with pytest.raises(LoongError, match=r"has 300 documents; data.split=1,1000,0 leaves none for training"):
        _build(shards, tok, None, split="1,1000,0")


def test_pretrain_task_takes_megatron_order_as_is(shards: dict, tok: Tokenizer) -> None:
    """Step s of the run feeds samples s*gbs ... in the dataset's (already shuffled) order."""
    from loong.llm.pretrain import PretrainTask

    train, _ = _build(shards, tok, [0.7, 0.3], n=40)
    task = object.__new__(PretrainTask)
    task.cfg = SimpleNamespace(train=SimpleNamespace(global_batch_size=4, micro_batch_size=2))
    task.layout = SimpleNamespace(dp_rank=0, cp=1)
    task.train_data, task.device = train, "cpu"
    batches = list(task.train_microbatches(step=3, num_microbatches=2))
    got = np.concatenate([np.concatenate([b["tokens"], b["labels"][:, -1:]], axis=1) for b in batches])
    assert np.array_equal(got, np.stack([train[i] for i in range(12, 16)]))


# --- training ----------------------------------------------------------------------------------
COMMON = [f"train.seq_length={SEQ}", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_interval=3",
          "train.eval_iters=1", "train.progress=false", "train.lr_decay_style=constant", "train.warmup_steps=2"]


def _train(*overrides: str) -> tuple[int, str]:
    from loong.llm.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["train", *COMMON, *overrides])
    sys.stderr.write(err.getvalue())
    return rc, err.getvalue()


def _losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]


@pytest.mark.slow
def test_training_resumes_exactly(shards: dict, tmp_path: Path) -> None:
    blend = f"data.paths=[0.7,{shards['a']},0.3,{shards['b']}]"
    rc, err = _train(blend, "train.steps=6", "train.save_interval=3", f"output_dir={tmp_path}", "run_name=r")
    assert rc == 0, err[-3000:]
    full = _losses(tmp_path / "r")
    assert [s for s, _ in full] == [1, 2, 3, 4, 5, 6]
    step3 = tmp_path / "r" / "checkpoints" / "step_00000003"
    rc, err = _train(blend, "train.steps=6", f"train.resume={step3}", f"output_dir={tmp_path}", "run_name=r")
    assert rc == 0 and "resumed from" in err, err[-3000:]
    resumed = _losses(tmp_path / "r")[6:]
    assert [s for s, _ in resumed] == [4, 5, 6]
    for (step, loss), (_, ref) in zip(resumed, full[3:], strict=True):
        assert abs(loss - ref) <= 1e-6, (step, loss, ref)


@pytest.mark.slow
def test_training_on_one_prefix_and_config_errors(shards: dict, tmp_path: Path) -> None:
    rc, err = _train(f"data.path={shards['a']}.bin", "train.steps=2", f"output_dir={tmp_path}", "run_name=one")
    assert rc == 0, err[-3000:]
    assert len(_losses(tmp_path / "one")) == 2
    rc, err = _train(f"data.paths=[0.7,{shards['a']},0.3]", f"output_dir={tmp_path}")
    assert rc == 2 and "error: data.paths: expected [weight, prefix, weight, prefix, ...] pairs, got 3 items" in err
    rc, err = _train(f"data.paths=[0.7,{shards['a']},0.3,{tmp_path}/none]", f"output_dir={tmp_path}")
    assert rc == 2 and f"missing {tmp_path}/none.bin" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one"]  # failed before writing anything
