"""Tokenised conversations packed into fixed-length sequences with per-document attention.

A conversation of ``n`` tokens is a *document* of ``n - 1`` slots: inputs ``ids[:-1]``, labels
``ids[1:]`` and the loss mask ``assistant_mask[1:]`` (a label is in the loss when the token it
predicts is an assistant token). With ``data.packing=true`` documents are packed best-fit
decreasing into sequences of ``train.seq_length`` slots, positions restarting at 0 per document;
per-token document ids keep every document to itself in attention (varlen attention,
:func:`loong.core.attention.varlen_attention`: no ``[s, s]`` mask, so 32K-token sequences fit). With
``data.packing=false`` each sequence holds one document followed by padding. Sequences are built once;
the sampler orders them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Document:
    """One conversation, shifted: ``ids`` (n tokens) and ``loss`` (n - 1 label flags)."""

    ids: np.ndarray
    loss: np.ndarray

    def __len__(self) -> int:
        return len(self.ids) - 1


@dataclass
class FitStats:
    """What :func:`fit_documents` did to over-long conversations."""

    kept: int = 0
    truncated: int = 0
    dropped: int = 0  # over-long with data.overlong=drop, or no assistant label left


def fit_documents(encoded: list[tuple[list[int], list[int]]], seq_length: int, overlong: str = "truncate"
                  ) -> tuple[list[Document], FitStats]:
    """Documents from ``(input_ids, assistant_mask)`` pairs, over-long ones truncated or dropped."""
    stats = FitStats()
    docs: list[Document] = []
    for ids, mask in encoded:
        ids_a, mask_a = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
        if len(ids_a) - 1 > seq_length:
            if overlong == "drop":
                stats.dropped += 1
                continue
            ids_a, mask_a = ids_a[: seq_length + 1], mask_a[: seq_length + 1]
            stats.truncated += 1
        loss = mask_a[1:]
        if not loss.any():  # nothing to learn (e.g. truncation cut every assistant token)
            stats.dropped += 1
            continue
        docs.append(Document(ids_a, loss))
    stats.kept = len(docs)
    return docs, stats


def pack_best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of document indices, best-fit decreasing (deterministic; ties by index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin)
    for i in order:
        need = lengths[i]
        k = bisect.bisect_left(free, (need, -1))
        if k < len(free):
            room, b = free.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - need > 0:
            bisect.insort(free, (room - need, b))
    return bins


class PackedSequences:
    """Sequences of ``seq_length`` slots, each a list of documents followed by padding."""

    def __init__(self, docs: list[Document], seq_length: int, packing: bool, pad_id: int) -> None:
        self.docs = docs
        self.seq_length = seq_length
        self.pad_id = pad_id
        lengths = [len(d) for d in docs]
        self.bins = pack_best_fit(lengths, seq_length) if packing else [[i] for i in range(len(docs))]
        self.real_tokens = sum(lengths)
        self.loss_tokens = np.array([sum(int(docs[i].loss.sum()) for i in b) for b in self.bins], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.bins)

    @property
    def efficiency(self) -> float:
        """Real tokens / slots (1.0 = no padding)."""
        return self.real_tokens / max(1, len(self.bins) * self.seq_length)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return pack_row(self.docs, self.bins[i], self.seq_length, self.pad_id)


def pack_row(docs: list[Document], members: list[int], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """One sequence of ``length`` slots: documents ``members`` of ``docs`` one after another, then padding."""
    tokens = np.full(length, pad_id, dtype=np.int64)
    labels = np.full(length, pad_id, dtype=np.int64)
    loss = np.zeros(length, dtype=np.float32)
    positions = np.zeros(length, dtype=np.int64)
    doc_ids = np.full(length, -1, dtype=np.int64)
    at = 0
    for k, d in enumerate(members):
        doc = docs[d]
        n = len(doc)
        tokens[at : at + n] = doc.ids[:-1]
        labels[at : at + n] = doc.ids[1:]
        loss[at : at + n] = doc.loss
        positions[at : at + n] = np.arange(n)
        doc_ids[at : at + n] = k
        at += n
    return {"tokens": tokens, "labels": labels, "loss_mask": loss, "position_ids": positions,
            "doc_ids": doc_ids}


def make_sft_microbatch(samples: list[dict[str, np.ndarray]], document_mask: bool = True) -> dict[str, torch.Tensor]:
    """Stack samples into tokens, labels, loss_mask, position_ids and ``attention_mask``.

    ``attention_mask`` is the document ids ``[b, s]`` (int64, -1 = padding), which the model's
    attention (:class:`loong.llm.models.attention.SDPAttention`) takes in place of a mask: causal
    attention within each document, padding attending to nothing. ``document_mask=False`` makes the
    whole sequence one document, plain causal attention (for tests: packed documents then see one another).
    """
    batch = {k: torch.from_numpy(np.stack([x[k] for x in samples])) for k in samples[0]}
    doc_ids = batch.pop("doc_ids")
    if not document_mask:
        doc_ids = torch.zeros_like(doc_ids)
    batch["attention_mask"] = doc_ids
    return batch
