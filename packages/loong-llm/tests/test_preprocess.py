"""``loong-llm preprocess``: text / JSONL / Parquet → megatron-core indexed shards.

Shards are read back with megatron-core's own ``IndexedDataset``: document ``i`` must be exactly
``tokenizer.encode(doc_i) + [eod]``. Errors must name the file and line, and must leave nothing at
the output prefix (no shards, no temporary files).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from loong.core.errors import LoongError
from loong.llm.data import preprocess as pp
from loong.llm.data.preprocess import preprocess, token_dtype
from loong.llm.data.tokenizer import Tokenizer, build_packaged_tokenizer, packaged_corpus_path

DOCS = ["The quick brown fox.", "  leading and trailing spaces  ", "unicode: δ λ 漢字 🙂", "x" * 3000,
        "def f(x):\\n    return x"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_packaged_tokenizer()


def _read(prefix: Path) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    assert len(ds.document_indices) == len(ds) + 1  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


def _expected(tok: Tokenizer, docs: list[str]) -> list[list[int]]:
    return [tok.encode(d) + [tok.eod_id] for d in docs]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- round trips ---------------------------------------------------------------------------------
def test_jsonl_round_trip_and_sidecar(tmp_path: Path, tok: Tokenizer) -> None:
    src = _jsonl(tmp_path / "c.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS)])
    s = preprocess([src], tmp_path / "out" / "shard", progress=False)
    assert _read(tmp_path / "out" / "shard") == _expected(tok, DOCS)
    assert (s["documents"], s["skipped"], s["dtype"]) == (len(DOCS), 0, "uint16")
    assert s["tokens"] == sum(map(len, _expected(tok, DOCS))) and s["tokens_per_s"] > 0
    meta = json.loads((tmp_path / "out" / "shard.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["eod_id"], meta["dtype"]) == ("packaged", 512, tok.eod_id, "uint16")
    assert meta["max_token_id"] < 512 and meta["documents"] == len(DOCS)
    assert _listing(tmp_path / "out") == ["shard.bin", "shard.idx", "shard.json"]


def test_text_is_one_document_per_non_empty_line(tmp_path: Path, tok: Tokenizer) -> None:
    src = tmp_path / "c.txt"
    src.write_text("first doc\n\n   \n  second doc  \r\nthird\n", encoding="utf-8")
    s = preprocess([src], tmp_path / "t", progress=False)
    assert _read(tmp_path / "t") == _expected(tok, ["first doc", "second doc", "third"])
    assert s["skipped"] == 0  # blank lines are no documents


def test_parquet_column_and_several_inputs_in_order(tmp_path: Path, tok: Tokenizer) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["alpha beta", "", "gamma δ"], "n": [1, 2, 3]}), tmp_path / "a.parquet")
    txt = tmp_path / "b.txt"
    txt.write_text("from text\n")
    s = preprocess([tmp_path / "a.parquet", txt], tmp_path / "p", text_field="body", progress=False)
    assert _read(tmp_path / "p") == _expected(tok, ["alpha beta", "gamma δ", "from text"])
    assert (s["documents"], s["skipped_empty"]) == (3, 1)


def test_parquet_errors(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["ok", None, "fine"]}), tmp_path / "n.parquet")
    with pytest.raises(LoongError, match=r"n\.parquet: row 2: column 'text' is not a string"):
        preprocess([tmp_path / "n.parquet"], tmp_path / "o", progress=False)
    assert preprocess([tmp_path / "n.parquet"], tmp_path / "o", on_error="skip", progress=False)["skipped_invalid"] == 1
    with pytest.raises(LoongError, match=r"no 'body' column \(found \['text'\]\)"):
        preprocess([tmp_path / "n.parquet"], tmp_path / "o2", text_field="body", progress=False)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(LoongError, match="not a readable Parquet file"):
        preprocess([tmp_path / "bad.parquet"], tmp_path / "o3", progress=False)


def test_dtype_follows_the_vocabulary() -> None:
    assert token_dtype(512) is np.uint16 and token_dtype(65_000) is np.uint16
    assert token_dtype(128_256) is np.int32 and token_dtype(151_936) is np.int32


# --- errors and skipping -------------------------------------------------------------------------
BROKEN = [{"text": "one"}, "", '{"text": "unterminated', {"text": "four"}]


@pytest.mark.parametrize(("rows", "message"), [
    (BROKEN, r"c\.jsonl:3: not valid JSON"),
    ([{"text": "a"}, {"body": "b"}], r"c\.jsonl:2: no 'text' field \(found \['body'\]\); set --text-field"),
    ([{"text": "a"}, {"text": "b"}, {"text": 3}], r"c\.jsonl:3: field 'text' is not a string \(int\)"),
    ([{"text": "a"}, "[1, 2]"], r"c\.jsonl:2: no 'text' field \(found list\)"),
])
def test_bad_record_names_file_and_line_and_leaves_nothing(tmp_path: Path, rows: list, message: str) -> None:
    src = _jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(LoongError, match=rf"^{re.escape(str(tmp_path))}/{message}"):
        preprocess([src], out / "shard", progress=False)
    assert _listing(tmp_path) == ["c.jsonl"]  # no shards, no temporary files, not even the folder it made


def test_skip_counts_bad_and_empty_records(tmp_path: Path, tok: Tokenizer) -> None:
    rows = [*BROKEN, {"body": "x"}, {"text": None}, {"text": ""}, {"text": "   "}, {"text": "last"}]
    src = _jsonl(tmp_path / "c.jsonl", rows)
    s = preprocess([src], tmp_path / "s", on_error="skip", progress=False)
    assert _read(tmp_path / "s") == _expected(tok, ["one", "four", "last"])
    assert (s["documents"], s["skipped_invalid"], s["skipped_empty"], s["skipped"]) == (3, 3, 2, 5)
    (tmp_path / "u.jsonl").write_bytes(b'{"text": "ok"}\n\xff\xfe\n')
    with pytest.raises(LoongError, match=r"u\.jsonl:2: not valid UTF-8"):
        preprocess([tmp_path / "u.jsonl"], tmp_path / "u", progress=False)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(LoongError, match="missing.jsonl does not exist"):
        preprocess([tmp_path / "missing.jsonl"], tmp_path / "o", progress=False)
    src = _jsonl(tmp_path / "c.jsonl", [{"text": ""}])
    with pytest.raises(LoongError, match="no documents"):
        preprocess([src], tmp_path / "o", progress=False)
    with pytest.raises(LoongError, match="data.tokenizer: .*nope does not exist"):
        preprocess([src], tmp_path / "o", tokenizer=str(tmp_path / "nope"), progress=False)
    assert _listing(tmp_path) == ["c.jsonl"]


def test_interrupt_leaves_nothing_and_keeps_previous_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _jsonl(tmp_path / "c.jsonl", [{"text": f"document {i}"} for i in range(3 * pp.CHUNK)])
    preprocess([src], tmp_path / "out" / "shard", progress=False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    real, calls = pp._process_chunk, []

    def interrupted(chunk: tuple) -> dict:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(chunk)

    monkeypatch.setattr(pp, "_process_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preprocess([src], tmp_path / "out" / "shard", progress=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


# --- worker processes ----------------------------------------------------------------------------
@pytest.mark.slow
def test_output_is_identical_with_one_and_two_workers(tmp_path: Path, tok: Tokenizer) -> None:
    corpus = packaged_corpus_path()  # 1330 documents: several chunks per worker
    one = preprocess([corpus], tmp_path / "w1", workers=1, progress=False)
    two = preprocess([corpus], tmp_path / "w2", workers=2, progress=False)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes(), ext
    assert (one["documents"], one["tokens"]) == (two["documents"], two["tokens"]) == (1330, one["tokens"])
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    assert _read(tmp_path / "w2")[:50] == _expected(tok, docs[:50])


@pytest.mark.slow
def test_worker_error_names_the_line_and_leaves_nothing(tmp_path: Path) -> None:
    rows = [{"text": f"document number {i}"} for i in range(3 * pp.CHUNK)]
    rows[2 * pp.CHUNK + 6] = '{"text": oops}'  # in the third chunk: the second worker's second task
    src = _jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(LoongError, match=rf"c\.jsonl:{2 * pp.CHUNK + 7}: not valid JSON"):
        preprocess([src], tmp_path / "out" / "shard", workers=2, progress=False)
    assert not (tmp_path / "out").exists()  # the folder the run made is removed with its partial shards


# --- the command ---------------------------------------------------------------------------------
def _cli(*argv: str) -> tuple[int, str, str]:
    from loong.llm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["preprocess", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_cli_preprocess(tmp_path: Path, tok: Tokenizer) -> None:
    src = _jsonl(tmp_path / "c.jsonl", [{"body": d} for d in DOCS] + [{"body": ""}])
    rc, out, err = _cli(str(src), "--output-prefix", str(tmp_path / "cli"), "--text-field", "body",
                        "--workers", "1", "--no-progress")
    assert rc == 0, err
    assert f"documents: {len(DOCS)}" in out and "skipped: 1 (1 empty, 0 invalid)" in out and "tokens/s:" in out
    assert _read(tmp_path / "cli") == _expected(tok, DOCS)
    rc, out, err = _cli(str(src), "--output-prefix", str(tmp_path / "bad"), "--workers", "1", "--no-progress")
    assert rc == 2 and re.search(r"error: .*c\.jsonl:1: no 'text' field", err)
    assert not list(tmp_path.glob("*bad*"))
