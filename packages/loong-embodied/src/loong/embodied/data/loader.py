"""The training loader over a :class:`~loong.embodied.data.mix.VLAMixture`: this rank's batches of the seeded
stream, decoded in DataLoader workers, put through the policy's processor there, pinned and prefetched to the
device.

API::

    loader = make_train_loader(mixture, batch_size=8, collate=processor, seed=0, start_sample=step * 8 * world,
                               rank=rank, world=world, num_workers=4, pin_memory=True, device="cuda")
    for batch in loader: ...          # endless (or num_batches); batch = collate(collate_vla(samples)), on device
    loader.num_skipped                # samples replaced under on_error="skip" so far (for logging)
    loader.skipped                    # the distinct ones, each reported once by a warning

- **Order**: batch ``b`` is rank ``rank``'s contiguous ``batch_size`` of global batch ``b`` of the stream
  (:class:`~loong.embodied.data.sampler.RankBatches`), a pure function of ``(seed, position)``; the batches are
  the same for any ``num_workers`` (a DataLoader returns batches in order), and ``start_sample`` resumes the
  exact stream at any global sample offset (resume at step ``k`` with ``k · batch_size · world``).
- **Collate**: ``collate`` (e.g. a :class:`~loong.embodied.policies.base.PolicyProcessor`, called as
  ``collate(raw_batch)``) runs in the workers on :func:`~loong.embodied.data.dataset.collate_vla`'s batch;
  the pair travels to workers by pickling (:class:`WorkerCollate`), so it must be a picklable object or a
  module-level function (not a lambda), as under the ``spawn`` start method.
- **Device**: ``pin_memory`` pins host batches (on CUDA only); ``device`` moves them with a
  :class:`DevicePrefetcher`: on CUDA the next batch is copied ``non_blocking`` on a side stream while the
  current one is used; elsewhere a plain ``.to(device)``.
- ``timeout`` > 0 fails a batch that a worker takes longer than that many seconds to make (0: wait forever).
- **Fork safety**: workers fork from the training process when it first iterates. A process that has itself
  decoded a *corrupt* AV1 video (FFmpeg/dav1d error paths) can crash the workers it forks afterwards (seen
  with PyAV 15 / dav1d: a segfault in the worker); decoding good videos before forking is fine. When the main
  process reads samples of doubtful data itself, pass ``multiprocessing_context="forkserver"`` (or
  ``"spawn"``; each worker then imports lerobot once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from loong.core.errors import LoongError
from loong.embodied.data.dataset import collate_vla
from loong.embodied.data.mix import SkippedSample, VLAMixture
from loong.embodied.data.sampler import RankBatches

logger = logging.getLogger("loong.embodied.data")


class _StreamReader(torch.utils.data.Dataset):
    """The mixture read by ``(source, k)`` keys, with what ``on_error="skip"`` skipped to read each."""

    def __init__(self, mixture: VLAMixture) -> None:
        self.mixture = mixture

    def __len__(self) -> int:
        return len(self.mixture)

    def __getitem__(self, key: tuple[int, int]) -> tuple[dict[str, Any], list[SkippedSample]]:
        return self.mixture.load(*key)


class WorkerCollate:
    """``collate ∘ collate_vla`` over ``(sample, skipped)`` pairs, returning ``(batch, skipped)``; picklable
    when ``collate`` is."""

    def __init__(self, collate: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.collate = collate

    def __call__(self, items: list[tuple[dict[str, Any], list[SkippedSample]]]) -> tuple[Any, list[SkippedSample]]:
        batch: Any = collate_vla([sample for sample, _ in items])
        if self.collate is not None:
            batch = self.collate(batch)
        return batch, [s for _, skipped in items for s in skipped]


def _to_device(data: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, dict):
        return {k: _to_device(v, device, non_blocking) for k, v in data.items()}
    if isinstance(data, (list, tuple)) and not isinstance(data, str):
        return type(data)(_to_device(v, device, non_blocking) for v in data)
    return data


def _record_stream(data: Any, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator that ``stream`` uses ``data``'s memory (copied on another stream)."""
    if isinstance(data, torch.Tensor):
        data.record_stream(stream)
    elif isinstance(data, dict):
        for v in data.values():
            _record_stream(v, stream)
    elif isinstance(data, (list, tuple)):
        for v in data:
            _record_stream(v, stream)


class DevicePrefetcher:
    """Batches of ``batches`` on ``device``: on CUDA, the next batch's host→device copy is issued
    (``non_blocking``, from pinned memory when it is pinned) on a side stream before the current batch is handed
    out, and the compute stream waits for it; on other devices a plain ``.to(device)``."""

    def __init__(self, batches: Iterable[Any], device: str | torch.device) -> None:
        self.batches, self.device = batches, torch.device(device)

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            for batch in self.batches:
                yield _to_device(batch, self.device, non_blocking=False)
            return
        side = torch.cuda.Stream(device=self.device)
        it = iter(self.batches)
        done = object()

        def issue() -> Any:
            host = next(it, done)
            if host is done:
                return done
            with torch.cuda.stream(side):
                return _to_device(host, self.device, non_blocking=True)

        pending = issue()
        while pending is not done:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(side)
            _record_stream(pending, compute)
            batch, pending = pending, issue()
            yield batch


class TrainLoader:
    """Rank ``rank``'s training batches of a mixture (see the module docstring); built by
    :func:`make_train_loader`. Iterating it again starts again from ``start_sample``."""

    def __init__(self, mixture: VLAMixture, *, batch_size: int, collate: Callable[[dict[str, Any]], Any] | None,
                 seed: int, start_sample: int, rank: int, world: int, num_workers: int, pin_memory: bool,
                 device: str | torch.device | None, timeout: float, prefetch_factor: int | None,
                 num_batches: int | None, multiprocessing_context: str | None) -> None:
        if not isinstance(num_workers, int) or num_workers < 0:
            raise LoongError(f"num_workers: must be an int >= 0, got {num_workers!r}")
        if timeout < 0:
            raise LoongError(f"timeout: must be >= 0 seconds, got {timeout!r}")
        self.mixture = mixture
        self.batch_sampler = RankBatches(mixture.stream(seed), batch_size=batch_size, rank=rank, world=world,
                                         start_sample=start_sample, num_batches=num_batches)
        self.device = None if device is None else torch.device(device)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.num_skipped = 0
        self.skipped: list[SkippedSample] = []
        self._seen: set[tuple[str, int, int]] = set()
        self.dataloader = torch.utils.data.DataLoader(
            _StreamReader(mixture), batch_sampler=self.batch_sampler, num_workers=num_workers,
            collate_fn=WorkerCollate(collate), pin_memory=self.pin_memory,
            timeout=timeout if num_workers > 0 else 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
            generator=torch.Generator().manual_seed(seed))

    @property
    def global_batch_size(self) -> int:
        """Samples all ranks together read per batch (what ``start_sample`` advances by per step)."""
        return self.batch_sampler.global_batch_size

    def _account(self, item: tuple[Any, list[SkippedSample]]) -> Any:
        batch, skipped = item
        for s in skipped:
            self.num_skipped += 1
            if (s.root, s.episode, s.row) not in self._seen:
                self._seen.add((s.root, s.episode, s.row))
                self.skipped.append(s)
                logger.warning("data.on_error=skip: replaced a sample that cannot be read: %s", s.message)
        return batch

    def _host_batches(self) -> Iterator[Any]:
        for item in self.dataloader:
            yield self._account(item)

    def __iter__(self) -> Iterator[Any]:
        if self.device is None:
            return self._host_batches()
        return iter(DevicePrefetcher(self._host_batches(), self.device))

    def __len__(self) -> int:
        return len(self.batch_sampler)


def make_train_loader(mixture: VLAMixture, *, batch_size: int, collate: Callable[[dict[str, Any]], Any] | None = None,
                      seed: int = 0, start_sample: int = 0, rank: int = 0, world: int = 1, num_workers: int = 0,
                      pin_memory: bool = False, device: str | torch.device | None = None, timeout: float = 0.0,
                      prefetch_factor: int | None = None, num_batches: int | None = None,
                      multiprocessing_context: str | None = None) -> TrainLoader:
    """Rank ``rank`` of ``world``'s loader of ``batch_size``-sample batches of ``mixture`` (module docstring).

    ``collate``: applied to each raw batch in the workers (the policy's processor); ``start_sample``: the global
    sample offset to start at; ``device``: where batches are delivered (None: left on the host);
    ``num_batches``: stop after that many (None: endless); ``multiprocessing_context``: the workers' start
    method (None: the platform's default)."""
    return TrainLoader(mixture, batch_size=batch_size, collate=collate, seed=seed, start_sample=start_sample,
                       rank=rank, world=world, num_workers=num_workers, pin_memory=pin_memory, device=device,
                       timeout=timeout, prefetch_factor=prefetch_factor, num_batches=num_batches,
                       multiprocessing_context=multiprocessing_context)


__all__ = ["DevicePrefetcher", "TrainLoader", "WorkerCollate", "make_train_loader"]
