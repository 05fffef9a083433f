"""Raw text, JSONL or Parquet → megatron-core indexed-dataset shards (``<prefix>.bin`` / ``.idx``).

Each document becomes one sequence of ``tokenizer.encode(doc) + [eod]`` in ``<prefix>.bin`` (uint16
when the vocabulary fits, else int32, megatron's rule), indexed by ``<prefix>.idx``; a small
``<prefix>.json`` sidecar records the tokenizer (name, vocabulary size and fingerprint) so that
training can refuse shards built with another vocabulary. Chunks of documents are tokenised by
worker processes and written in input order, so the output does not depend on the worker count.
Everything is written under temporary names and renamed at the end: an error or an interrupt
leaves nothing at the prefix.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import Any, Literal

import numpy as np

from loong.core.data import count_lines
from loong.core.errors import LoongError
from loong.llm.data.text import json_record_text
from loong.llm.data.tokenizer import Tokenizer, load_tokenizer

CHUNK = 256  # records per task sent to a worker
FORMATS = ("auto", "text", "jsonl", "parquet")

# (source name, 1-based number of the first record, "text" | "jsonl" | "parquet", raw records)
Chunk = tuple[str, int, str, list]
_STATE: dict[str, Any] = {}  # the tokenizer and options of this (worker) process


def token_dtype(vocab_size: int) -> type[np.unsignedinteger] | type[np.signedinteger]:
    """uint16 when every id fits (megatron's ``DType.optimal_dtype``), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def vocab_fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of the id → token mapping (equal for the same vocabulary wherever it is stored)."""
    items = sorted(tokenizer.hf.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def resolve_format(path: Path, fmt: str) -> str:
    """``auto`` → ``jsonl`` (.jsonl/.json/.ndjson), ``parquet`` (.parquet/.pq) or ``text``."""
    if fmt not in FORMATS:
        raise LoongError(f"--format {fmt!r} is not one of {list(FORMATS)}")
    if fmt != "auto":
        return fmt
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    return "parquet" if path.suffix in (".parquet", ".pq") else "text"



# --- worker side -----------------------------------------------------------------------------
def _init_worker(tokenizer: Tokenizer | str, text_field: str, on_error: str) -> None:
    """Pool initializer: load the tokenizer in this process (workers ignore Ctrl-C; the parent handles it)."""
    if not isinstance(tokenizer, Tokenizer):  # a worker process: one tokenizer thread each
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            tokenizer = load_tokenizer(tokenizer)
        except Exception as exc:  # reported by the first chunk (a failing initializer would respawn forever)
            _STATE["init_error"] = str(exc)
            return
    _STATE.update(tok=tokenizer, field=text_field, on_error=on_error,
                  dtype=token_dtype(tokenizer.vocab_size))


def _document(kind: str, raw: Any, field: str) -> str | None:
    """The text of one record (None for a blank line); raises ValueError with the reason."""
    if kind == "parquet":
        if not isinstance(raw, str):
            raise ValueError(f"column '{field}' is not a string ({type(raw).__name__})")
        return raw
    try:
        line = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 ({exc.reason})") from None
    if not line or kind == "text":
        return line or None
    return json_record_text(line, field, "--text-field")


def _process_chunk(chunk: Chunk) -> dict[str, Any]:
    """Tokenise one chunk: flat tokens (EOD after each document), per-document lengths and counts."""
    if "init_error" in _STATE:
        return {"error": _STATE["init_error"]}
    source, first, kind, records = chunk
    tok, field, on_error = _STATE["tok"], _STATE["field"], _STATE["on_error"]
    docs: list[str] = []
    empty = invalid = 0
    for offset, raw in enumerate(records):
        try:
            text = _document(kind, raw, field)
        except ValueError as exc:
            where = f"{source}:{first + offset}" if kind != "parquet" else f"{source}: row {first + offset}"
            if on_error == "raise":
                return {"error": f"{where}: {exc}"}
            invalid += 1
            continue
        if text is None:
            continue  # a blank line is no record
        if text.strip():
            docs.append(text)
        else:
            empty += 1
    ids = tok.encode_batch(docs) if docs else []
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    eod = tok.eod_id
    flat = np.fromiter(chain.from_iterable(chain(x, (eod,)) for x in ids), dtype=_STATE["dtype"],
                       count=int(lengths.sum()))
    return {"tokens": flat, "lengths": lengths, "records": len(records), "empty": empty, "invalid": invalid}


# --- main side -------------------------------------------------------------------------------
def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise LoongError(f"{path}: not a readable Parquet file ({exc})") from None


def _chunks(path: Path, kind: str, text_field: str) -> Iterator[Chunk]:
    if kind == "parquet":
        pf = _parquet(path)
        if text_field not in pf.schema_arrow.names:
            raise LoongError(f"{path}: no '{text_field}' column (found {pf.schema_arrow.names}); "
                             "set --text-field")
        row = 1
        for batch in pf.iter_batches(batch_size=CHUNK, columns=[text_field]):
            values = batch.column(0).to_pylist()
            yield str(path), row, kind, values
            row += len(values)
        return
    with path.open("rb") as fh:
        lineno, lines = 1, []
        for line in fh:
            lines.append(line)
            if len(lines) == CHUNK:
                yield str(path), lineno, kind, lines
                lineno, lines = lineno + CHUNK, []
        if lines:
            yield str(path), lineno, kind, lines


def _ordered(fn: Callable[[Chunk], dict], chunks: Iterator[Chunk], pool: Any, window: int
             ) -> Iterator[dict]:
    """``pool.imap(fn, chunks)`` in input order with at most ``window`` chunks in flight (bounded memory)."""
    if pool is None:
        yield from map(fn, chunks)
        return
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(fn, (chunk,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _progress(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]preprocess"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TextColumn("{task.fields[docs]:,} docs  {task.fields[docs_s]:,.0f} docs/s  {task.fields[tok_s]:,.0f} tok/s"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not enabled,
    )


def preprocess(inputs: Sequence[str | Path], output_prefix: str | Path, tokenizer: str | None = None,
               fmt: str = "auto", text_field: str = "text", workers: int = 1,
               on_error: Literal["raise", "skip"] = "raise", progress: bool = True) -> dict[str, Any]:
    """Tokenise ``inputs`` into ``<output_prefix>.bin``/``.idx`` (+ ``.json``); returns a summary.

    ``tokenizer``: a local Hugging Face tokenizer folder, or None for the packaged tokenizer.
    ``fmt``: ``auto`` (from each file's suffix), ``text`` (one document per non-empty line),
    ``jsonl`` (``text_field`` of each line's object) or ``parquet`` (the ``text_field`` column).
    ``on_error``: ``raise`` fails on the first malformed record (``file:line: reason``); ``skip``
    counts it in ``summary["skipped_invalid"]``. Empty documents are always skipped and counted.

    The summary holds ``documents``, ``tokens``, ``skipped`` (``skipped_empty`` + ``skipped_invalid``),
    ``max_token_id``, ``dtype``, ``seconds`` (the whole call, tokenizer loading included),
    ``tokenize_seconds`` (reading, tokenising and writing) and ``tokens_per_s`` (over ``seconds``).
    """
    if on_error not in ("raise", "skip"):
        raise LoongError(f"--on-error {on_error!r} is not one of ['raise', 'skip']")
    if workers < 1:
        raise LoongError(f"--workers must be >= 1, got {workers}")
    paths = [Path(p) for p in inputs]
    if not paths:
        raise LoongError("no input files")
    for p in paths:
        if not p.is_file():
            raise LoongError(f"input {p} {'is not a file' if p.exists() else 'does not exist'}")
    kinds = [resolve_format(p, fmt) for p in paths]
    prefix = Path(output_prefix)
    made = [d for d in (prefix.parent, *prefix.parent.parents) if not d.exists()]  # deepest first
    prefix.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tmp = {ext: prefix.with_name(f".{prefix.name}.{os.getpid()}.tmp{ext}") for ext in (".bin", ".idx", ".json")}
    counts = {"documents": 0, "tokens": 0, "skipped_empty": 0, "skipped_invalid": 0, "max_token_id": -1}
    tok_dir = tempfile.TemporaryDirectory(prefix="loong-tok-") if workers > 1 and tokenizer is None else None
    pool = builder = None

    def start_workers(path: str) -> Any:  # they load the tokenizer while this process counts lines
        return multiprocessing.get_context("spawn").Pool(workers, _init_worker, (path, text_field, on_error))

    try:
        if workers > 1 and tokenizer is not None:
            pool = start_workers(tokenizer)
        tok = load_tokenizer(tokenizer)
        if tok_dir is not None:  # the packaged tokenizer: workers load a saved copy
            tok.save(tok_dir.name)
            pool = start_workers(tok_dir.name)
        if pool is None:
            _init_worker(tok, text_field, on_error)
        dtype = token_dtype(tok.vocab_size)
        from megatron.core.datasets.indexed_dataset import (
            IndexedDatasetBuilder,  # slow import: after the pool starts
        )

        total = sum(_parquet(p).metadata.num_rows if k == "parquet" else count_lines(p)
                    for p, k in zip(paths, kinds, strict=True))
        builder = IndexedDatasetBuilder(str(tmp[".bin"]), dtype=dtype)
        chunks = chain.from_iterable(_chunks(p, k, text_field) for p, k in zip(paths, kinds, strict=True))
        loop_start = time.perf_counter()
        with _progress(progress) as bar:
            task = bar.add_task("preprocess", total=total or None, docs=0, docs_s=0.0, tok_s=0.0)
            for out in _ordered(_process_chunk, chunks, pool, window=4 * workers):
                if "error" in out:
                    raise LoongError(out["error"])
                flat, lengths = out["tokens"], out["lengths"]
                ends = np.cumsum(lengths)
                for end, length in zip(ends.tolist(), lengths.tolist(), strict=True):
                    builder.add_document(flat[end - length:end], [length])
                counts["documents"] += len(ends)
                counts["tokens"] += len(flat)
                counts["skipped_empty"] += out["empty"]
                counts["skipped_invalid"] += out["invalid"]
                if len(flat):
                    counts["max_token_id"] = max(counts["max_token_id"], int(flat.max()))
                dt = max(time.perf_counter() - loop_start, 1e-9)
                bar.update(task, advance=out["records"], docs=counts["documents"],
                           docs_s=counts["documents"] / dt, tok_s=counts["tokens"] / dt)
        if not counts["documents"]:
            raise LoongError(f"{', '.join(map(str, paths))}: no documents (empty input, or every record skipped)")
        builder.finalize(str(tmp[".idx"]))
        seconds, loop_seconds = time.perf_counter() - started, time.perf_counter() - loop_start
        meta = {"tokenizer": tok.source, "vocab_size": tok.vocab_size, "vocab_fingerprint": vocab_fingerprint(tok),
                "eod_id": tok.eod_id, "dtype": np.dtype(dtype).name, **counts,
                "inputs": [str(p) for p in paths], "text_field": text_field}
        tmp[".json"].write_text(json.dumps(meta, indent=1) + "\n")
        for ext, path in tmp.items():
            os.replace(path, f"{prefix}{ext}")
    except BaseException:
        if builder is not None and not builder.data_file.closed:
            builder.data_file.close()
        for path in tmp.values():
            path.unlink(missing_ok=True)
        for d in made:  # a failed run leaves no folder of its own behind (but never removes one it did not make)
            try:
                d.rmdir()
            except OSError:
                break
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if tok_dir is not None:
            tok_dir.cleanup()
        _STATE.clear()
    return {"output_prefix": str(prefix), "files": [f"{prefix}{ext}" for ext in tmp], **counts,
            "skipped": counts["skipped_empty"] + counts["skipped_invalid"], "dtype": np.dtype(dtype).name,
            "seconds": round(seconds, 3), "tokenize_seconds": round(loop_seconds, 3),
            "tokens_per_s": round(counts["tokens"] / seconds, 1) if seconds else None}
