"""The training loader over a mixture: the same batches for any number of workers, resume at a sample offset,
data-parallel slices, the collate hook in the workers, bad data skipped deterministically (a corrupt video, a
sample that raises), and the device prefetcher.

The oracle for every batch is the mixture read directly (``collate_vla`` over ``mixture.load`` of the stream's
``(source, k)``), which ``test_data_mix.py`` checks against the datasets' recorded values.
"""

from __future__ import annotations

import logging
import pickle
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from loong.core.errors import LoongError
from loong.embodied.data.dataset import collate_vla
from loong.embodied.data.loader import DevicePrefetcher, WorkerCollate, make_train_loader
from loong.embodied.data.mix import build_mixture
from loong.embodied.data.synthetic import write_reach_dataset

sys.path.insert(0, str(Path(__file__).parent))
from data_testing import write_tiny_dataset  # noqa: E402

CHUNK = 3
WRIST = "observation.images.wrist"


class AddStateSum:
    """A picklable collate hook standing in for a policy processor: drops the strings, adds a derived tensor."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        out["state_sum"] = batch["observation.state"].sum(-1) * self.scale
        return out


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    base = tmp_path_factory.mktemp("loader")
    a = write_tiny_dataset(base / "a", state_dim=2, action_dim=2, cameras=["top", "wrist"], lengths=[5, 7], tag=0)
    b = write_tiny_dataset(base / "b", state_dim=3, action_dim=4, cameras=["top"], lengths=[6, 4, 3], tag=1000)
    video = write_reach_dataset(base / "video", num_episodes=3, image_size=32, progress=False)
    return SimpleNamespace(a=a, b=b, video=video, mixture=build_mixture([a, b], [0.6, 0.4], chunk_size=CHUNK))


def _same_batches(xs: list[dict[str, Any]], ys: list[dict[str, Any]]) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert list(x) == list(y)
        for key in x:
            assert torch.equal(x[key], y[key]) if isinstance(x[key], torch.Tensor) else x[key] == y[key], key


def _direct(mixture: Any, seed: int, first: int, count: int) -> dict[str, Any]:
    keys = zip(*mixture.stream(seed).locate_range(first, count), strict=True)
    return collate_vla([mixture.load(*key)[0] for key in keys])


def test_batches_are_the_stream_and_do_not_depend_on_workers(data: SimpleNamespace) -> None:
    hook = AddStateSum(2.0)
    runs = {w: list(make_train_loader(data.mixture, batch_size=4, collate=hook, seed=7, num_workers=w, num_batches=6,
                                      timeout=60)) for w in (0, 2)}
    _same_batches(runs[0], runs[2])
    for b, batch in enumerate(runs[0]):
        want = hook(_direct(data.mixture, 7, 4 * b, 4))
        _same_batches([batch], [want])
        assert "task" not in batch and torch.equal(batch["state_sum"], want["observation.state"].sum(-1) * 2)
    other_seed = list(make_train_loader(data.mixture, batch_size=4, seed=8, num_batches=6))
    assert [b["index"].tolist() for b in other_seed] != [b["index"].tolist() for b in runs[0]]
    # what travels to the workers pickles (as under the spawn start method)
    collate = pickle.loads(pickle.dumps(WorkerCollate(hook)))
    samples = [data.mixture.load(0, k) for k in range(3)]
    _same_batches([collate(samples)[0]], [hook(collate_vla([s for s, _ in samples]))])
    restored = pickle.loads(pickle.dumps(data.mixture))
    _same_batches([collate_vla([restored[(1, 2)]])], [collate_vla([data.mixture[(1, 2)]])])


def _samples(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batches' samples, one dict each, in order."""
    return [{k: v[i] for k, v in batch.items()} for batch in batches for i in range(len(batch["index"]))]


def test_resume_at_a_sample_offset_continues_the_stream(data: SimpleNamespace) -> None:
    full = _samples(list(make_train_loader(data.mixture, batch_size=3, seed=1, num_batches=20)))
    for start, workers in ((9, 0), (7, 1), (40, 0)):  # a step boundary, any offset, past the first epoch (25)
        resumed = list(make_train_loader(data.mixture, batch_size=3, seed=1, start_sample=start, num_batches=4,
                                         num_workers=workers))
        _same_batches(_samples(resumed), full[start:start + 12])


def test_data_parallel_ranks_read_slices_of_the_global_batch(data: SimpleNamespace) -> None:
    whole = list(make_train_loader(data.mixture, batch_size=6, seed=2, num_batches=4))
    ranks = [list(make_train_loader(data.mixture, batch_size=2, seed=2, rank=r, world=3, num_batches=4))
             for r in range(3)]
    assert make_train_loader(data.mixture, batch_size=2, rank=1, world=3).global_batch_size == 6
    for b, global_batch in enumerate(whole):
        for key, value in global_batch.items():
            parts = [ranks[r][b][key] for r in range(3)]
            if isinstance(value, torch.Tensor):
                assert torch.equal(torch.cat(parts), value), key
            else:
                assert [x for p in parts for x in p] == value


def test_embodiment_ids_follow_the_weights(data: SimpleNamespace) -> None:
    mixture = build_mixture([data.a, data.b], [0.8, 0.2], chunk_size=CHUNK, embodiment_ids=[3, 11])
    ids = torch.cat([b["embodiment_id"] for b in make_train_loader(mixture, batch_size=10, num_batches=10)])
    assert set(ids.tolist()) == {3, 11} and abs((ids == 3).float().mean().item() - 0.8) < 0.06


def _truncated_copy(src: Path, dst: Path) -> tuple[Path, Path]:
    root = Path(shutil.copytree(src, dst))
    video = root / "videos" / WRIST / "chunk-000" / "file-000.mp4"
    video.write_bytes(video.read_bytes()[: video.stat().st_size * 2 // 5])
    return root, video


def test_a_corrupt_video_fails_or_is_skipped_deterministically(data: SimpleNamespace, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    root, video = _truncated_copy(data.video, tmp_path / "corrupt")
    skipping = build_mixture([root], chunk_size=CHUNK, on_error="skip")
    n = len(skipping.frames[0])
    caplog.set_level(logging.WARNING, logger="loong.embodied.data")
    # the worker loader first, from a fork server: a process that has decoded a corrupt AV1 file (or, like this
    # pytest process, a great deal else) is not safe to fork (loader docs); CI once saw the forked worker segfault
    loaders = {w: make_train_loader(skipping, batch_size=n, num_batches=2, num_workers=w, timeout=120,
                                    multiprocessing_context="forkserver" if w else None) for w in (1, 0)}
    batches = {w: list(loader) for w, loader in loaders.items()}
    _same_batches(batches[0], batches[1])
    # the oracle: which frames read, one by one, with on_error="fail"
    failing = build_mixture([root], chunk_size=CHUNK)
    good = []
    for k in range(n):
        try:
            failing.load(0, k)
            good.append(k)
        except LoongError as exc:
            assert re.search(re.escape(f"{video}: the video of '{WRIST}' for episode ") + r"\d cannot be decoded",
                             str(exc))
    assert 0 < len(good) < n  # the cut leaves the first episodes readable
    with pytest.raises(LoongError, match=re.escape(f"{video}: the video of '{WRIST}'")):
        list(make_train_loader(failing, batch_size=n, num_batches=1))
    # each bad frame is replaced by the next readable one of its source (wrapping), and counted
    stream_ks = skipping.stream(0).locate_range(0, 2 * n)[1]
    want_ks = [next((k + j) % n for j in range(n) if (k + j) % n in good) for k in stream_ks]
    want_skips = sum((w - k) % n for k, w in zip(stream_ks, want_ks, strict=True))
    rows = [skipping.frames[0].row(k) for k in want_ks]
    assert torch.cat([b["index"] for b in batches[0]]).tolist() == [
        int(skipping.sources[0].lerobot.hf_dataset[r]["index"]) for r in rows]
    for loader in loaders.values():
        assert loader.num_skipped == want_skips > 0
        assert sorted(s.row for s in loader.skipped) == sorted(set(range(n)) - set(good))
        assert all(str(video) in s.message and s.root == str(root) for s in loader.skipped)
    reports = [r for r in caplog.records if "replaced a sample that cannot be read" in r.getMessage()]
    assert len(reports) == 2 * (n - len(good))  # each bad sample once per loader, however often it was met


def test_a_sample_that_raises_is_named_or_skipped(data: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    mixture = build_mixture([data.a, data.b], chunk_size=CHUNK)
    source = mixture.sources[1]
    bad_row = mixture.frames[1].row(2)
    original = type(source).__getitem__

    def broken(self: Any, idx: int) -> dict[str, Any]:
        if self is source and idx == bad_row:
            raise KeyError("observation.state")
        return original(self, idx)

    monkeypatch.setattr(type(source), "__getitem__", broken)
    with pytest.raises(LoongError, match=re.escape(f"{data.b}: episode 0 (row {bad_row}) cannot be read: key "
                                                   "'observation.state': KeyError")):
        mixture.load(1, 2)
    mixture.on_error = "skip"
    sample, skipped = mixture.load(1, 2)
    assert int(sample["index"]) == int(mixture.load(1, 3)[0]["index"]) and len(skipped) == 1
    assert (skipped[0].root, skipped[0].episode, skipped[0].row) == (str(data.b), 0, bad_row)


def test_device_prefetcher_yields_the_same_batches(data: SimpleNamespace) -> None:
    host = list(make_train_loader(data.mixture, batch_size=4, num_batches=3))
    _same_batches(list(DevicePrefetcher(host, "cpu")), host)
    _same_batches(list(make_train_loader(data.mixture, batch_size=4, num_batches=3, device="cpu", pin_memory=True)),
                  host)
    loader = make_train_loader(data.mixture, batch_size=2, num_workers=2, timeout=30, prefetch_factor=3)
    assert (loader.dataloader.timeout, loader.dataloader.prefetch_factor, loader.pin_memory) == (30, 3, False)
    with pytest.raises(LoongError, match="timeout: must be >= 0"):
        make_train_loader(data.mixture, batch_size=2, timeout=-1)


@pytest.mark.gpu
def test_pinned_cuda_prefetch_yields_the_same_batches(data: SimpleNamespace) -> None:
    host = list(make_train_loader(data.mixture, batch_size=4, num_batches=4))
    loader = make_train_loader(data.mixture, batch_size=4, num_batches=4, num_workers=2, pin_memory=True,
                               device="cuda")
    assert loader.pin_memory
    pinned = next(iter(loader.dataloader))[0]
    assert pinned["observation.state"].is_pinned()
    moved = list(loader)
    assert all(b["action"].is_cuda for b in moved)
    torch.cuda.synchronize()
    _same_batches([{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in moved], host)
