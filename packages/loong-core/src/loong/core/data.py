"""Data plumbing every modality shares: one data-parallel rank's micro-batches of a global batch, and the line count
of a data file (the total of a preprocessing progress bar)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def rank_microbatches(sample: Callable[[int], dict[str, torch.Tensor]], first: int, global_batch_size: int,
                      dp: int, dp_rank: int, num_microbatches: int) -> Iterator[dict[str, torch.Tensor]]:
    """The micro-batches of DP rank ``dp_rank`` for the global batch of samples ``first .. first + global_batch_size
    - 1``: each rank takes a contiguous ``global_batch_size / dp`` of them, cut into ``num_microbatches`` equal
    micro-batches, each sample's tensors stacked along a new batch dim. With ``sample`` a pure function of the index,
    every layout reads the same global batch and a resumed run the same samples."""
    per_rank = global_batch_size // dp
    mbs = per_rank // num_microbatches
    start = first + dp_rank * per_rank
    for m in range(num_microbatches):
        samples = [sample(start + m * mbs + i) for i in range(mbs)]
        yield {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def count_lines(path: Path) -> int:
    """Lines of a file (a last line without a newline counts), counted in 1 MiB binary blocks without decoding."""
    n, last = 0, b"\n"
    with Path(path).open("rb") as fh:
        while block := fh.read(1 << 20):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")
