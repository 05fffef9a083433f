"""Text data: reading corpora, tokenising, packing, the resumable sampler and the packaged tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from loong.core.errors import LoongError
from loong.llm.data.text import (
    GlobalBatchSampler,
    PackedTokens,
    make_microbatch,
    read_documents,
    split_stream,
    tokenize_corpus,
)
from loong.llm.data.tokenizer import (
    EOD_TOKEN,
    PACKAGED_VOCAB_SIZE,
    Tokenizer,
    build_packaged_tokenizer,
    load_tokenizer,
    packaged_corpus_path,
)


class CharTokenizer:
    """One id per character (its code point), EOD = 0: makes token streams easy to predict."""

    eod_id = 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[ord(c) for c in t] for t in texts]


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- read_documents -----------------------------------------------------------------------------


def test_text_file_is_one_document_per_non_empty_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.txt", "first doc\n\n   \n  second doc  \nthird\n")
    assert list(read_documents(path)) == ["first doc", "second doc", "third"]


def test_jsonl_reads_the_text_field(tmp_path: Path) -> None:
    rows = [{"body": "alpha", "id": 1}, {"body": ""}, {"body": "gamma δ", "meta": {"x": 1}}]
    path = _write(tmp_path / "c.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(read_documents(path, text_field="body")) == ["alpha", "gamma δ"]  # empty texts are skipped


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".ndjson"])
def test_auto_format_from_suffix(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path / f"c{suffix}", '{"text": "a b"}\n')
    assert list(read_documents(path)) == ["a b"]


def test_explicit_format_overrides_the_suffix(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.txt", '{"text": "inside"}\n')
    assert list(read_documents(path, fmt="jsonl")) == ["inside"]
    assert list(read_documents(path, fmt="text")) == ['{"text": "inside"}']


def test_broken_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.jsonl", '{"text": "ok"}\n\n{"text": "broken\n{"text": "later"}\n')
    docs = read_documents(path)
    assert next(docs) == "ok"  # errors surface lazily, at the bad line
    with pytest.raises(LoongError, match=rf"^{re.escape(str(path))}:3: not valid JSON"):
        next(docs)


def test_missing_field_names_the_field_and_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.jsonl", '{"text": "ok"}\n{"content": "x", "id": 2}\n')
    with pytest.raises(LoongError) as err:
        list(read_documents(path))
    msg = str(err.value)
    assert msg.startswith(f"{path}:2: no 'text' field")
    assert "['content', 'id']" in msg and "data.text_field" in msg


def test_non_object_and_non_string_records_are_errors(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.jsonl", "[1, 2]\n")
    with pytest.raises(LoongError, match=rf"^{re.escape(str(path))}:1: no 'text' field \(found list\)"):
        list(read_documents(path))
    path = _write(tmp_path / "d.jsonl", '{"text": 5}\n')
    with pytest.raises(LoongError, match=rf"^{re.escape(str(path))}:1: field 'text' is not a string"):
        list(read_documents(path))


def test_missing_path_and_directory(tmp_path: Path) -> None:
    with pytest.raises(LoongError, match="does not exist"):
        list(read_documents(tmp_path / "nope.txt"))
    with pytest.raises(LoongError, match="is a directory"):
        list(read_documents(tmp_path))


# --- tokenize_corpus ----------------------------------------------------------------------------


def test_tokenize_corpus_joins_documents_with_eod(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.txt", "ab\nc\n\nde\n")
    stream = tokenize_corpus(path, CharTokenizer())
    assert stream.dtype == np.int32
    assert stream.tolist() == [97, 98, 0, 99, 0, 100, 101, 0]
    # batching is an implementation detail: any batch size gives the same stream
    assert tokenize_corpus(path, CharTokenizer(), batch=1).tolist() == stream.tolist()
    assert tokenize_corpus(path, CharTokenizer(), batch=2).tolist() == stream.tolist()


@pytest.mark.parametrize(
    ("name", "text"), [("e.txt", ""), ("b.txt", "\n  \n\n"), ("e.jsonl", '{"text": ""}\n')]
)
def test_empty_corpus_is_an_error(tmp_path: Path, name: str, text: str) -> None:
    path = _write(tmp_path / name, text)
    with pytest.raises(LoongError, match=r"empty corpus"):
        tokenize_corpus(path, CharTokenizer())


# --- packing and splitting ----------------------------------------------------------------------


def test_packed_windows_overlap_by_exactly_one_token() -> None:
    seq = 8
    packed = PackedTokens(np.arange(100, dtype=np.int32), seq)
    assert len(packed) == (100 - 1) // seq == 12
    windows = [packed[i] for i in range(len(packed))]
    for i, w in enumerate(windows):
        assert len(w) == seq + 1
        assert w.tolist() == list(range(i * seq, i * seq + seq + 1))
    for a, b in zip(windows, windows[1:], strict=False):
        assert a[-1] == b[0]  # the last label of one window is the first input of the next
        assert len(set(a.tolist()) & set(b.tolist())) == 1
    # inputs of consecutive windows tile the stream with no gap and no repeat
    inputs = np.concatenate([w[:-1] for w in windows])
    assert inputs.tolist() == list(range(len(packed) * seq))


@pytest.mark.parametrize(("n", "expected"), [(8 * 5 + 1, 5), (8 * 5, 4), (9, 1), (8, 0), (0, 0)])
def test_packed_length_is_every_full_window(n: int, expected: int) -> None:
    packed = PackedTokens(np.arange(n), 8)
    assert len(packed) == expected
    if expected:
        assert len(packed[expected - 1]) == 9


def test_split_stream_holds_out_the_tail() -> None:
    tokens = np.arange(1000, dtype=np.int32)
    train, valid = split_stream(tokens, 16, 0.1, "src")
    assert np.concatenate([train.tokens, valid.tokens]).tolist() == tokens.tolist()
    assert len(valid.tokens) == 100 and valid.tokens[0] == 900
    assert len(train) == (900 - 1) // 16 and len(valid) == (100 - 1) // 16
    # a tiny fraction is rounded up to at least one validation window
    train, valid = split_stream(tokens, 16, 0.001, "src")
    assert len(valid.tokens) == 17 and len(valid) == 1
    train, valid = split_stream(tokens, 16, 0.0, "src")
    assert len(valid) == 0 and len(train.tokens) == 1000


def test_split_stream_too_small_is_a_clear_error() -> None:
    seq = 8
    # smallest stream that works: one train window (seq+1) plus one valid window (seq+1)
    train, valid = split_stream(np.arange(2 * (seq + 1)), seq, 0.05, "corpus.txt")
    assert (len(train), len(valid)) == (1, 1)
    with pytest.raises(LoongError) as err:
        split_stream(np.arange(2 * (seq + 1) - 1), seq, 0.05, "corpus.txt")
    msg = str(err.value)
    assert "corpus.txt" in msg and "17 tokens" in msg and "train.seq_length=8" in msg
    with pytest.raises(LoongError, match="too few"):
        split_stream(np.arange(5), seq, 0.0, "corpus.txt")


# --- the sampler --------------------------------------------------------------------------------


def _indices(sampler: GlobalBatchSampler, gs) -> list[int]:  # noqa: ANN001
    return [sampler.index(g) for g in gs]


def test_sampler_is_deterministic_for_a_seed() -> None:
    assert _indices(GlobalBatchSampler(37, seed=7), range(200)) == _indices(
        GlobalBatchSampler(37, seed=7), range(200)
    )


def test_sampler_visits_every_sample_once_per_epoch() -> None:
    n = 37
    s = GlobalBatchSampler(n, seed=7)
    epochs = [_indices(s, range(e * n, (e + 1) * n)) for e in range(4)]
    for perm in epochs:
        assert sorted(perm) == list(range(n))
    assert len({tuple(p) for p in epochs}) == 4  # a fresh order each epoch
    assert epochs[0] != list(range(n))  # actually shuffled


def test_sampler_differs_across_seeds() -> None:
    assert _indices(GlobalBatchSampler(50, seed=1), range(50)) != _indices(
        GlobalBatchSampler(50, seed=2), range(50)
    )


def test_sampler_index_is_independent_of_call_order() -> None:
    """Resume: a fresh sampler asked for samples 100..110 returns what the uninterrupted run saw."""
    n = 37
    sequential = _indices(GlobalBatchSampler(n, seed=3), range(111))
    assert _indices(GlobalBatchSampler(n, seed=3), range(100, 111)) == sequential[100:]
    rng = np.random.default_rng(0)
    order = rng.permutation(111).tolist()
    fresh = GlobalBatchSampler(n, seed=3)
    scattered = {g: fresh.index(g) for g in order}  # jumps back and forth across epochs
    assert [scattered[g] for g in range(111)] == sequential


def test_sampler_without_shuffle_is_sequential() -> None:
    assert _indices(GlobalBatchSampler(5, seed=1, shuffle=False), range(12)) == [0, 1, 2, 3, 4] * 2 + [0, 1]


# --- micro-batches ------------------------------------------------------------------------------


def test_make_microbatch_shapes_dtypes_and_shift() -> None:
    seq = 6
    packed = PackedTokens(np.arange(100, dtype=np.int32), seq)
    windows = [packed[i] for i in (0, 3, 5)]
    mb = make_microbatch(windows)
    assert set(mb) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert (
        mb["tokens"].shape
        == mb["labels"].shape
        == mb["loss_mask"].shape
        == mb["position_ids"].shape
        == (3, seq)
    )
    assert mb["tokens"].dtype == mb["labels"].dtype == mb["position_ids"].dtype == torch.int64
    assert mb["loss_mask"].dtype == torch.float32 and bool((mb["loss_mask"] == 1).all())
    for row, w in enumerate(windows):
        assert mb["tokens"][row].tolist() == w[:-1].tolist()
        assert mb["labels"][row].tolist() == w[1:].tolist()
    assert torch.equal(mb["labels"][:, :-1], mb["tokens"][:, 1:])
    assert mb["position_ids"].tolist() == [list(range(seq))] * 3
    for t in mb.values():
        assert t.is_contiguous()


# --- the packaged tokenizer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def packaged() -> Tokenizer:
    return build_packaged_tokenizer()


SAMPLES = [
    "def add(a, b):\n    return a + b\n",
    "Return the number of items in a container.",
    "  leading spaces, tabs\tand trailing newline\n",
    "unicode: héllo wörld — 世界 🙂",
    "",
]


def test_packaged_tokenizer_shape(packaged: Tokenizer) -> None:
    assert packaged.vocab_size == PACKAGED_VOCAB_SIZE == 512
    assert packaged.eod_id == packaged.hf.convert_tokens_to_ids(EOD_TOKEN)
    assert 0 <= packaged.eod_id < packaged.vocab_size
    assert packaged.source == "packaged"
    assert packaged_corpus_path().is_file()


def test_packaged_tokenizer_is_deterministic(packaged: Tokenizer) -> None:
    again = build_packaged_tokenizer()
    assert again.hf.get_vocab() == packaged.hf.get_vocab()
    assert again.eod_id == packaged.eod_id
    for text in SAMPLES:
        assert again.encode(text) == packaged.encode(text)


@pytest.mark.parametrize("text", SAMPLES)
def test_packaged_tokenizer_round_trips(packaged: Tokenizer, text: str) -> None:
    ids = packaged.encode(text)
    assert packaged.eod_id not in ids  # no special tokens added
    assert all(0 <= i < packaged.vocab_size for i in ids)
    assert packaged.hf.decode(ids) == text


def test_packaged_tokenizer_compresses_its_corpus_domain(packaged: Tokenizer) -> None:
    text = SAMPLES[1]
    assert len(packaged.encode(text)) < len(text.encode()) // 2  # merges were learnt, not just bytes


def test_encode_batch_matches_encode(packaged: Tokenizer) -> None:
    assert packaged.encode_batch(SAMPLES) == [packaged.encode(t) for t in SAMPLES]


def test_saved_tokenizer_loads_back(packaged: Tokenizer, tmp_path: Path) -> None:
    packaged.save(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded.vocab_size == packaged.vocab_size
    assert loaded.eod_id == packaged.eod_id
    for text in SAMPLES:
        assert loaded.encode(text) == packaged.encode(text)


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(LoongError, match=r"data\.tokenizer: .* does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoongError, match=r"data\.tokenizer: cannot load a tokenizer from"):
        load_tokenizer(str(tmp_path / "empty"))


def test_tokenize_corpus_with_the_packaged_tokenizer(packaged: Tokenizer, tmp_path: Path) -> None:
    path = _write(tmp_path / "c.jsonl", "\n".join(json.dumps({"text": t}) for t in SAMPLES[:3]))
    stream = tokenize_corpus(path, packaged)
    assert int((stream == packaged.eod_id).sum()) == 3 and stream[-1] == packaged.eod_id
    docs = np.split(stream, np.flatnonzero(stream == packaged.eod_id) + 1)[:-1]
    assert [packaged.hf.decode(d[:-1].tolist()) for d in docs] == SAMPLES[:3]
