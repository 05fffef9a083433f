"""Which frames a training run reads, in which order: episode-aware frame lists and the mixture's sample stream.

API::

    frames = EpisodeFrames.from_dataset(vla_dataset, drop_first=0, drop_last=0)   # one source's usable frames
    stream = MixtureStream(sizes=[len(f) for f in frames_per_source], weights=[0.7, 0.3], seed=0)
    stream.locate(position) -> (source, k)            # the stream's sample at a global position
    stream.locate_range(first, count) -> ([source], [k])
    batches = RankBatches(stream, batch_size=8, rank=r, world=n, start_sample=s)   # iterable of [(source, k)]

**Episode-aware** (lerobot's ``EpisodeAwareSampler`` idea): a source's usable frames are its selected episodes'
frames less the first ``drop_first`` and last ``drop_last`` of each episode (an episode left with none is left
out); ``k`` indexes that list, :meth:`EpisodeFrames.row` maps it to the ``VLADataset`` row.

**The stream** is an endless sequence of ``(source, k)``, cut into epochs of ``epoch_size`` samples (default:
all usable frames of all sources). Epoch ``e`` holds a fixed quota of samples per source, ``weights``
(normalised; default: proportional to the sources' sizes, so an epoch reads every frame exactly once) times the
epoch size, rounded by largest remainder; their order is a permutation drawn from ``(seed, e)``. Source ``d``'s
samples are its own endless stream of passes over its frames, pass ``j`` a permutation drawn from
``(seed, d, j)``, consumed in order across epochs. So a position's sample is a pure function of ``(seed,
position)``: nothing is replayed to resume, and every rank computes the same stream without communication.

**Data-parallel slices**: global batch ``b`` is positions ``start_sample + b·G ... + G - 1`` with ``G =
batch_size · world``; rank ``r`` reads the contiguous ``batch_size`` of them from ``r · batch_size`` (the
convention of ``loong.core.data.rank_microbatches``). A run resumed at step ``k`` passes ``start_sample = k·G`` and
continues the exact stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from loong.core.errors import LoongError

if TYPE_CHECKING:
    from loong.embodied.data.dataset import VLADataset

_ORDER_TAG, _PASS_TAG = 0, 1  # keep the seed streams of epoch orders and per-source passes apart


def _rng(*entropy: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(e) for e in entropy])))


@dataclass(frozen=True)
class EpisodeFrames:
    """One source's usable frames: ``rows[k]`` the ``VLADataset`` row, ``episodes[k]`` its episode index."""

    rows: np.ndarray
    episodes: np.ndarray

    @classmethod
    def from_dataset(cls, dataset: VLADataset, *, drop_first: int = 0, drop_last: int = 0) -> EpisodeFrames:
        """The frames of ``dataset``'s episodes without the first ``drop_first`` / last ``drop_last`` of each."""
        for name, value in (("drop_first_frames", drop_first), ("drop_last_frames", drop_last)):
            if not isinstance(value, int) or value < 0:
                raise LoongError(f"{name}: must be an int >= 0, got {value!r}")
        table = dataset.meta.episodes
        starts = np.asarray(table["dataset_from_index"], dtype=np.int64)
        ends = np.asarray(table["dataset_to_index"], dtype=np.int64)  # exclusive
        used = dataset.episodes if dataset.episodes is not None else range(len(starts))
        to_relative = dataset.lerobot.absolute_to_relative_idx
        rows, episodes = [], []
        for ep in used:
            absolute = np.arange(starts[ep] + drop_first, ends[ep] - drop_last, dtype=np.int64)
            if to_relative is not None:
                absolute = np.asarray([to_relative[int(i)] for i in absolute], dtype=np.int64)
            rows.append(absolute)
            episodes.append(np.full(len(absolute), ep, dtype=np.int64))
        frames = cls(np.concatenate(rows), np.concatenate(episodes))
        if len(frames) == 0:
            raise LoongError(f"{dataset.root}: no frames left after dropping {drop_first} first and {drop_last} last "
                             f"frames of each of its {len(list(used))} episodes")
        return frames

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, k: int) -> int:
        """The ``VLADataset`` row of usable frame ``k``."""
        return int(self.rows[k])


def _quotas(weights: np.ndarray, total: int) -> np.ndarray:
    """``weights`` (summing to 1) times ``total``, rounded to integers summing to ``total`` (largest remainder)."""
    exact = weights * total
    quotas = np.floor(exact).astype(np.int64)
    short = total - int(quotas.sum())
    if short > 0:
        quotas[np.argsort(-(exact - quotas), kind="stable")[:short]] += 1
    return quotas


class MixtureStream:
    """The endless, seeded sample stream over sources of ``sizes`` usable frames (see the module docstring)."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float] | None = None, *, seed: int = 0,
                 epoch_size: int | None = None) -> None:
        self.sizes = np.asarray([int(s) for s in sizes], dtype=np.int64)
        if len(self.sizes) == 0 or (self.sizes < 1).any():
            raise LoongError(f"a mixture needs at least one source, each with a frame; got sizes {list(sizes)}")
        if weights is None:
            w = self.sizes.astype(np.float64)
        else:
            w = np.asarray([float(x) for x in weights], dtype=np.float64)
            if len(w) != len(self.sizes):
                raise LoongError(f"data.weights: {len(w)} weights for {len(self.sizes)} datasets; give one each")
            if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
                raise LoongError(f"data.weights: {list(weights)} must be finite, >= 0 and not all 0")
        self.weights = w / w.sum()
        self.epoch_size = int(self.sizes.sum()) if epoch_size is None else int(epoch_size)
        if self.epoch_size < 1:
            raise LoongError(f"epoch_size: must be >= 1, got {epoch_size!r}")
        self.seed = int(seed)
        self.quotas = _quotas(self.weights, self.epoch_size)
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _pass(self, source: int, j: int) -> np.ndarray:
        return _rng(self.seed, _PASS_TAG, source, j).permutation(int(self.sizes[source]))

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``e``'s ``(sources, ks)``, each ``[epoch_size]`` (the last two epochs are cached)."""
        if e not in self._cache:
            sources = np.repeat(np.arange(len(self.sizes), dtype=np.int64), self.quotas)
            sources = sources[_rng(self.seed, _ORDER_TAG, e).permutation(len(sources))]
            ks = np.empty_like(sources)
            for d, quota in enumerate(self.quotas):
                where = np.flatnonzero(sources == d)
                draws = e * int(quota) + np.arange(len(where), dtype=np.int64)  # source d's draws so far, in order
                n = int(self.sizes[d])
                passes, offsets = np.divmod(draws, n)
                for j in np.unique(passes):
                    sel = passes == j
                    ks[where[sel]] = self._pass(d, int(j))[offsets[sel]]
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[e] = (sources, ks)
        return self._cache[e]

    def locate(self, position: int) -> tuple[int, int]:
        """The ``(source, k)`` at global ``position`` of the stream."""
        sources, ks = self.locate_range(position, 1)
        return sources[0], ks[0]

    def locate_range(self, first: int, count: int) -> tuple[list[int], list[int]]:
        """The ``(source, k)`` of positions ``first .. first + count - 1``, as two lists."""
        if first < 0:
            raise LoongError(f"start_sample: must be >= 0, got {first}")
        out_s: list[int] = []
        out_k: list[int] = []
        position, end = first, first + count
        while position < end:
            e, offset = divmod(position, self.epoch_size)
            take = min(end - position, self.epoch_size - offset)
            sources, ks = self.epoch(e)
            out_s += sources[offset:offset + take].tolist()
            out_k += ks[offset:offset + take].tolist()
            position += take
        return out_s, out_k


class RankBatches:
    """Rank ``rank`` of ``world``'s batches of the stream from ``start_sample`` on: an iterable (a DataLoader
    ``batch_sampler``) of lists of ``(source, k)``; endless unless ``num_batches`` is given."""

    def __init__(self, stream: MixtureStream, *, batch_size: int, rank: int = 0, world: int = 1,
                 start_sample: int = 0, num_batches: int | None = None) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise LoongError(f"batch_size: must be an int >= 1, got {batch_size!r}")
        if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or not 0 <= rank < world:
            raise LoongError(f"rank {rank!r} of world {world!r}: need 0 <= rank < world")
        if not isinstance(start_sample, int) or start_sample < 0:
            raise LoongError(f"start_sample: must be an int >= 0, got {start_sample!r}")
        self.stream, self.batch_size, self.rank, self.world = stream, batch_size, rank, world
        self.start_sample, self.num_batches = start_sample, num_batches

    @property
    def global_batch_size(self) -> int:
        """Samples every rank together reads per batch."""
        return self.batch_size * self.world

    def batch(self, b: int) -> list[tuple[int, int]]:
        """This rank's part of global batch ``b`` (counted from ``start_sample``)."""
        first = self.start_sample + b * self.global_batch_size + self.rank * self.batch_size
        sources, ks = self.stream.locate_range(first, self.batch_size)
        return list(zip(sources, ks, strict=True))

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        b = 0
        while self.num_batches is None or b < self.num_batches:
            yield self.batch(b)
            b += 1

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("an endless RankBatches has no length (give num_batches)")
        return self.num_batches


__all__ = ["EpisodeFrames", "MixtureStream", "RankBatches"]
