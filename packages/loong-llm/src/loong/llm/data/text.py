"""Raw text / JSONL corpora tokenised on the fly and packed into fixed-length samples.

Documents are joined with the end-of-document token into one token stream, which is cut into
windows of ``seq_length + 1`` tokens (inputs and shifted labels) that start every ``seq_length``
tokens, so each window's last token is the next one's first, as in Megatron-LM pretraining. The last ``valid_fraction`` of the stream is held out for evaluation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loong.core.errors import LoongError
from loong.llm.data.tokenizer import Tokenizer


def json_record_text(line: str, text_field: str, hint: str) -> str:
    """The text field of one JSONL line; ValueError names what is wrong (``hint``: how to set the field)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict) or text_field not in record:
        keys = list(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"no '{text_field}' field (found {keys}); set {hint}")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"field '{text_field}' is not a string ({type(text).__name__})")
    return text


def read_documents(path: Path, fmt: str = "auto", text_field: str = "text") -> Iterator[str]:
    """Yield documents: one per JSONL line (``text_field``), or one per non-empty line of text."""
    if not path.exists():
        raise LoongError(f"data.path: {path} does not exist")
    if path.is_dir():
        raise LoongError(f"data.path: {path} is a directory; give a .txt or .jsonl file")
    if fmt == "auto":
        fmt = "jsonl" if path.suffix in (".jsonl", ".json", ".ndjson") else "text"
    with path.open("rb") as fh:  # bytes: a bad byte is reported with its line, not as a decoder traceback
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise LoongError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason}); re-encode the file as UTF-8") \
                    from None
            if not line:
                continue
            if fmt == "text":
                yield line
                continue
            try:
                text = json_record_text(line, text_field, "data.text_field")
            except ValueError as exc:
                raise LoongError(f"{path}:{lineno}: {exc}") from None
            if text:
                yield text


def tokenize_corpus(path: Path, tokenizer: Tokenizer, fmt: str = "auto", text_field: str = "text",
                    batch: int = 256) -> np.ndarray:
    """The whole corpus as one int32 token stream, each document followed by the EOD token."""
    stream: list[int] = []
    docs: list[str] = []

    def flush() -> None:
        if not docs:  # the tokenizer fails on an empty batch (empty corpus, or a multiple of ``batch``)
            return
        for ids in tokenizer.encode_batch(docs):
            stream.extend(ids)
            stream.append(tokenizer.eod_id)
        docs.clear()

    for doc in read_documents(path, fmt, text_field):
        docs.append(doc)
        if len(docs) >= batch:
            flush()
    flush()
    if not stream:
        raise LoongError(f"data.path: {path} holds no text (empty corpus)")
    return np.asarray(stream, dtype=np.int32)


@dataclass
class PackedTokens:
    """A token stream viewed as windows of ``seq_length + 1`` tokens."""

    tokens: np.ndarray
    seq_length: int

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_length
        return self.tokens[start : start + self.seq_length + 1]


def split_stream(tokens: np.ndarray, seq_length: int, valid_fraction: float, source: str
                 ) -> tuple[PackedTokens, PackedTokens]:
    """Train/valid split of a token stream (valid = the tail), with a clear error when too small."""
    n_valid = int(len(tokens) * valid_fraction)
    if valid_fraction > 0:
        n_valid = max(n_valid, seq_length + 1)
    train = PackedTokens(tokens[: len(tokens) - n_valid], seq_length)
    valid = PackedTokens(tokens[len(tokens) - n_valid :], seq_length)
    if len(train) == 0:
        raise LoongError(
            f"data.path: {source} has {len(tokens)} tokens, too few for one training sample of "
            f"train.seq_length={seq_length} (plus a validation split)"
        )
    return train, valid


class GlobalBatchSampler:
    """Deterministic sample order from the seed; resumable from a count of consumed samples.

    Sample ``g`` of the run is ``perm_e[g % n]`` with a fresh seeded permutation per epoch ``e``, so
    a run resumed after ``c`` samples sees exactly what the uninterrupted run saw next.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True) -> None:
        self.n = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def index(self, g: int) -> int:
        epoch, pos = divmod(g, self.n)
        if not self.shuffle:
            return pos
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        assert self._perm is not None
        return int(self._perm[pos])


def make_microbatch(windows: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Inputs, shifted labels, loss mask and positions for one micro-batch."""
    data = torch.from_numpy(np.stack(windows).astype(np.int64))
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    b, s = tokens.shape
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.ones(b, s, dtype=torch.float32),
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
    }
