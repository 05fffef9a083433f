"""The VLM training data: a torch ``Dataset`` of packed rows whose media are decoded in DataLoader workers,
and the collate function that makes micro-batches.

:func:`prepare_vision_data` runs the setup (read → plan → fit → pack) once; :func:`vision_loader` wraps a
dataset in a ``DataLoader`` fed by any iterable of micro-batch row-index lists. A micro-batch of ``b`` rows of
``s`` slots has exactly these keys:

==========================  =========================  ==========================================================
key                         shape, dtype               meaning
==========================  =========================  ==========================================================
``tokens``                  ``[b, s]`` int64           input token ids (padding: the pad id)
``labels``                  ``[b, s]`` int64           the next token of each input (shifted by one, as loong-llm)
``loss_mask``               ``[b, s]`` float32         1 where the label is an assistant token to learn
``position_ids``            ``[3, b, s]`` int64        M-RoPE (temporal, height, width), restarting at 0 per
                                                       sample; ``[b, s]`` for 1-D schemes; 0 on padding
``document_ids``            ``[b, s]`` int64           sample index within its row, -1 = padding (the core's
                                                       ``varlen_attention`` document ids)
``mm_token_type_ids``       ``[b, s]`` int64           0 text, 1 image placeholder, 2 video placeholder: where the
                                                       projected vision features go, in order
``pixel_values``            Qwen ``[P, C·T·p·p]``      Qwen: the images' flattened patches, ``P = Σ t·h·w``;
                            InternVL ``[n, 3, H, W]``  InternVL: every tile of the images and every frame of the
                            float32                    videos (one tile a frame), in token order
``image_grid_thw``          ``[k, 3]`` int64           Qwen only: each image's ``(1, h, w)`` patch grid
``pixel_values_videos``     ``[V, C·T·p·p]`` float32   Qwen only: the videos' flattened patches
``video_grid_thw``          ``[m, 3]`` int64           Qwen only: each video's ``(t, h, w)`` patch grid
``skipped_samples``         ``[]`` int64               samples of this micro-batch whose media failed to decode
                                                       (``on_error=skip``): left as padding
==========================  =========================  ==========================================================

Media tensors are concatenated over the micro-batch in token order (row 0's samples first), possibly with
zero rows. An image contributes ``t·h·w / merge²`` placeholder tokens for ``t·h·w`` patches (Qwen) or
``image_seq_length`` a tile (InternVL).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from loong.core.errors import LoongError
from loong.llm.sft.formats import ReadStats
from loong.vlm.data.conversations import read_vision_conversations
from loong.vlm.data.encode import EncodedSample, decode_media, plan_all, process_media
from loong.vlm.data.media import MediaError
from loong.vlm.data.packing import FitStats, PackedVisionSequences, fit_samples, pack_row
from loong.vlm.data.processors import VisionProcessor
from loong.vlm.data.rope_index import RopeScheme

ON_ERROR = ("raise", "skip")
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class VisionSFTDataset(Dataset):
    """Row ``i`` of ``packed`` with its media decoded and processed (in the worker that asks for it)."""

    def __init__(self, packed: PackedVisionSequences, processor: VisionProcessor, scheme: RopeScheme,
                 on_error: str = "raise") -> None:
        if on_error not in ON_ERROR:
            raise LoongError(f"data.on_error: {on_error!r} is not one of {', '.join(ON_ERROR)}")
        self.packed = packed
        self.processor = processor
        self.scheme = scheme
        self.on_error = on_error

    def __len__(self) -> int:
        return len(self.packed)

    def _decode(self, sample: EncodedSample) -> list[Any] | None:
        try:
            return [decode_media(m) for m in sample.media]
        except MediaError as exc:
            if self.on_error != "skip":
                raise LoongError(f"{sample.source}:{sample.line}: {exc} (data.on_error=skip skips such "
                                 "samples)") from None
            return None

    def __getitem__(self, i: int) -> dict[str, Any]:
        samples = [self.packed.samples[k] for k in self.packed.bins[i]]
        decoded = [self._decode(s) for s in samples]
        keep = [d is not None for d in decoded]
        items = [m for s, ok in zip(samples, keep, strict=True) if ok for m in s.media]
        media = [x for d in decoded if d is not None for x in d]
        try:
            pixels = process_media(self.processor, items, media)
        except MediaError as exc:
            # rare (the decode succeeded, the processor refused): name every sample of the row
            where = ", ".join(f"{s.source}:{s.line}" for s in samples)
            raise LoongError(f"{where}: {exc}") from None
        row: dict[str, Any] = pack_row(samples, self.packed.seq_length, self.packed.pad_id, self.scheme, keep)
        row.update(pixels)
        row["skipped_samples"] = keep.count(False)
        return row


def collate_vision(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack rows into a micro-batch (the module docstring lists the keys)."""
    batch: dict[str, torch.Tensor] = {}
    for key in ("tokens", "labels", "loss_mask", "document_ids", "mm_token_type_ids"):
        batch[key] = torch.from_numpy(np.stack([r[key] for r in rows]))
    positions = torch.from_numpy(np.stack([r["position_ids"] for r in rows]))
    batch["position_ids"] = positions.permute(1, 0, 2).contiguous() if positions.dim() == 3 else positions
    for key in MEDIA_KEYS:
        if key in rows[0]:
            batch[key] = torch.cat([r[key] for r in rows], dim=0)
    batch["skipped_samples"] = torch.tensor(sum(int(r["skipped_samples"]) for r in rows), dtype=torch.int64)
    return batch


def vision_loader(dataset: VisionSFTDataset, batches: Iterable[list[int]], num_workers: int = 0,
                  prefetch_factor: int = 2) -> DataLoader:
    """A ``DataLoader`` yielding the micro-batch of each row-index list of ``batches`` (any iterable, e.g. an
    endless generator of a run's schedule), decoding in ``num_workers`` worker processes (0: in this one)."""
    if num_workers < 0:
        raise LoongError(f"data.num_workers: must be >= 0, got {num_workers}")
    extra: dict[str, Any] = {"prefetch_factor": prefetch_factor, "persistent_workers": True} if num_workers else {}
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate_vision, num_workers=num_workers, **extra)


@dataclass
class VisionData:
    """What :func:`prepare_vision_data` made: the train/valid datasets and the counts for the run summary."""

    train: VisionSFTDataset
    valid: VisionSFTDataset
    read_stats: ReadStats
    fit_stats: FitStats

    def summary(self, path: Path | str) -> str:
        """One line: conversations, skips by reason, truncation, packing efficiency."""
        r, f, tr = self.read_stats, self.fit_stats, self.train.packed
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(r.skipped.items()))
        skipped = f"{r.skipped_lines} skipped ({reasons})" if r.skipped_lines else "0 skipped"
        media = sum(len(s.media) for s in tr.samples) + sum(len(s.media) for s in self.valid.packed.samples)
        return (f"vlm data: {Path(path).name}: {len(tr.samples) + len(self.valid.packed.samples)} samples used "
                f"({len(tr.samples)} train, {len(self.valid.packed.samples)} valid; {media} images/videos), "
                f"{skipped}, {f.truncated} truncated ({f.media_dropped} media cut off), {f.dropped} dropped; "
                f"template {self.train.processor.template.name}; {len(tr)} sequences of {tr.seq_length}, "
                f"packing efficiency {tr.efficiency:.1%}")


def prepare_vision_data(path: Path | str, processor: VisionProcessor, scheme: RopeScheme, seq_length: int, *,
                        packing: bool = True, overlong: str = "truncate", on_error: str = "raise",
                        chat_format: str = "auto", media_root: Path | str | None = None,
                        valid_fraction: float = 0.0) -> VisionData:
    """Read a conversations JSONL, plan every sample from its media headers, fit and pack them.

    The last ``valid_fraction`` of the samples (at least one when > 0 and there are two or more) is the
    validation set.
    """
    if on_error not in ON_ERROR:
        raise LoongError(f"data.on_error: {on_error!r} is not one of {', '.join(ON_ERROR)}")
    if not 0 <= valid_fraction < 1:
        raise LoongError(f"data.valid_fraction: must be in [0, 1), got {valid_fraction}")
    path = Path(path)
    conversations, stats = read_vision_conversations(path, chat_format, on_error,
                                                     Path(media_root) if media_root is not None else None)
    planned = plan_all(processor, conversations, path, on_error, stats)
    n_valid = 0
    if valid_fraction > 0 and len(planned) > 1:
        n_valid = max(1, int(len(planned) * valid_fraction))
    train, fit = fit_samples(planned[: len(planned) - n_valid], seq_length, overlong)
    valid, valid_fit = fit_samples(planned[len(planned) - n_valid :], seq_length, overlong)
    for k in ("truncated", "dropped", "media_dropped"):
        setattr(fit, k, getattr(fit, k) + getattr(valid_fit, k))
    if not train:
        raise LoongError(f"data.path: {path}: no sample is left to train on ({len(planned)} planned, "
                         f"{fit.dropped} dropped at seq_length={seq_length}, {stats.skipped_lines} skipped)")
    pad = processor.pad_id
    return VisionData(VisionSFTDataset(PackedVisionSequences(train, seq_length, packing, pad), processor, scheme,
                                       on_error),
                      VisionSFTDataset(PackedVisionSequences(valid, seq_length, packing, pad), processor, scheme,
                                       on_error),
                      stats, fit)
