"""Planned samples packed into sequences of ``seq_length`` slots, each sample its own document.

As loong-llm's SFT packing (:mod:`loong.llm.sft.packing`, whose best-fit bin packing this reuses): a sample of
``n`` tokens is a document of ``n - 1`` slots, inputs ``ids[:-1]``, labels ``ids[1:]``, loss mask
``assistant_mask[1:]``. Per-token document ids (0, 1, ... per sample in the row, -1 for padding) keep every
sample to itself in the core's varlen attention; position ids are computed for each sample alone
(:mod:`.rope_index`) and concatenated, so M-RoPE ids restart at 0 per sample. A row's media are its samples'
media in token order.

A sample longer than ``seq_length`` after its placeholders are expanded is, by ``data.overlong``:

- ``truncate``: cut to ``seq_length + 1`` tokens, or earlier so that no image or video unit is cut: the cut
  moves to the start of the first unit that would not fit, and that media and all after it are dropped
  (counted in :attr:`FitStats.media_dropped`); a sample left with nothing to learn is dropped;
- ``drop``: left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from loong.core.errors import LoongError
from loong.llm.sft.packing import pack_best_fit
from loong.vlm.data.encode import EncodedSample
from loong.vlm.data.rope_index import RopeScheme

OVERLONG = ("truncate", "drop")


@dataclass
class FitStats:
    """What :func:`fit_samples` did to over-long samples."""

    kept: int = 0
    truncated: int = 0
    dropped: int = 0  # over-long with overlong=drop, or nothing left to learn after truncation
    media_dropped: int = 0  # images/videos cut off by truncation


def truncate_sample(sample: EncodedSample, keep: int) -> EncodedSample:
    """The first ``keep`` tokens of ``sample``, or fewer: never part of a media unit."""
    cut = keep
    kept_media = []
    for item in sample.media:  # media are in token order
        if item.span[1] <= cut:
            kept_media.append(item)
        else:
            cut = min(cut, item.span[0])
            break
    return replace(sample, input_ids=sample.input_ids[:cut], assistant_mask=sample.assistant_mask[:cut],
                   mm_token_type_ids=sample.mm_token_type_ids[:cut], media=kept_media)


def fit_samples(samples: list[EncodedSample], seq_length: int, overlong: str = "truncate"
                ) -> tuple[list[EncodedSample], FitStats]:
    """Samples that fit ``seq_length`` slots (``len - 1 <= seq_length``), over-long ones truncated or dropped."""
    if overlong not in OVERLONG:
        raise LoongError(f"data.overlong: {overlong!r} is not one of {', '.join(OVERLONG)}")
    if seq_length < 1:
        raise LoongError(f"train.seq_length: must be >= 1, got {seq_length}")
    stats = FitStats()
    out: list[EncodedSample] = []
    for sample in samples:
        if len(sample) - 1 > seq_length:
            if overlong == "drop":
                stats.dropped += 1
                continue
            cut = truncate_sample(sample, seq_length + 1)
            stats.media_dropped += len(sample.media) - len(cut.media)
            stats.truncated += 1
            sample = cut
        if len(sample) < 2 or not sample.assistant_mask[1:].any():  # nothing to learn
            stats.dropped += 1
            continue
        out.append(sample)
    stats.kept = len(out)
    return out, stats


class PackedVisionSequences:
    """Rows of ``seq_length`` slots: lists of sample indices (``bins``), best-fit packed or one per row."""

    def __init__(self, samples: list[EncodedSample], seq_length: int, packing: bool, pad_id: int) -> None:
        self.samples = samples
        self.seq_length = seq_length
        self.pad_id = pad_id
        lengths = [len(s) - 1 for s in samples]
        if any(n > seq_length for n in lengths):
            raise LoongError(f"a sample has more than seq_length={seq_length} slots; fit_samples() first")
        self.bins = pack_best_fit(lengths, seq_length) if packing else [[i] for i in range(len(samples))]
        self.real_tokens = sum(lengths)
        self.loss_tokens = np.array([sum(int(samples[i].assistant_mask[1:].sum()) for i in b) for b in self.bins],
                                    dtype=np.int64)

    def __len__(self) -> int:
        return len(self.bins)

    @property
    def efficiency(self) -> float:
        """Real tokens / slots (1.0 = no padding)."""
        return self.real_tokens / max(1, len(self.bins) * self.seq_length)

    def vision_tokens(self, i: int) -> list[int]:
        """Placeholder tokens of each image/video of row ``i`` (the encoder's cost terms)."""
        return [m.num_tokens for s in self.bins[i] for m in self.samples[s].media]


def pack_row(samples: list[EncodedSample], length: int, pad_id: int, scheme: RopeScheme,
             keep: list[bool] | None = None) -> dict[str, np.ndarray]:
    """One row of ``length`` slots: ``samples`` one after another (those with ``keep[k]`` False left as
    padding), then padding. Keys: ``tokens``, ``labels``, ``loss_mask`` (float32), ``position_ids``
    (``[3, length]`` or ``[length]``), ``document_ids`` (-1 = padding), ``mm_token_type_ids``."""
    tokens = np.full(length, pad_id, dtype=np.int64)
    labels = np.full(length, pad_id, dtype=np.int64)
    loss = np.zeros(length, dtype=np.float32)
    positions = np.zeros((3, length) if scheme.is_mrope else (length,), dtype=np.int64)
    doc_ids = np.full(length, -1, dtype=np.int64)
    mm = np.zeros(length, dtype=np.int64)
    at = 0
    for k, sample in enumerate(samples):
        n = len(sample) - 1
        if keep is None or keep[k]:
            tokens[at : at + n] = sample.input_ids[:-1]
            labels[at : at + n] = sample.input_ids[1:]
            loss[at : at + n] = sample.assistant_mask[1:]
            positions[..., at : at + n] = sample.positions(scheme)[..., :-1]
            doc_ids[at : at + n] = k
            mm[at : at + n] = sample.mm_token_type_ids[:-1]
        at += n
    return {"tokens": tokens, "labels": labels, "loss_mask": loss, "position_ids": positions,
            "document_ids": doc_ids, "mm_token_type_ids": mm}
