"""The synthetic reach dataset written and read back through lerobot's LeRobotDataset (frames, tasks, stats), the
cache, action chunks and padding against lerobot and against the recorded episodes, the DataLoader, normalisation
against the stats file's numbers, and every bad input's error.

lerobot's import costs 10-35 s here, so one module-scoped fixture writes the datasets once (six episodes as AV1
video, two as PNG images) and every test reads them; the oracle for frames and chunks is the in-memory expert
episodes the writer recorded, regenerated from the same seed.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loong.core.errors import LoongError
from loong.embodied.data.dataset import VLADataset, collate_vla, make_dataloader, probe_video
from loong.embodied.data.normalize import Normalizer
from loong.embodied.data.synthetic import FPS, ensure_reach_dataset, expert_episodes, reach_dataset_name
from loong.embodied.envs import CAMERAS

EPISODES = 6
CHUNK = 5
TOP, WRIST = (f"observation.images.{camera}" for camera in CAMERAS)


@pytest.fixture(scope="module")
def reach(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The video and image datasets (seed 0) in one cache folder, and the expert episodes they hold."""
    cache = tmp_path_factory.mktemp("cache")
    video = ensure_reach_dataset(cache, num_episodes=EPISODES, seed=0, use_videos=True, progress=True)
    image = ensure_reach_dataset(cache, num_episodes=2, seed=0, use_videos=False, progress=False)
    episodes = list(expert_episodes(EPISODES, seed=0))
    starts = np.cumsum([0] + [len(e) for e in episodes]).tolist()
    return SimpleNamespace(cache=cache, video=video, image=image, episodes=episodes, starts=starts)


def _chw(image: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(image).permute(2, 0, 1).float() / 255


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_written_dataset_reads_back_through_lerobot(reach: SimpleNamespace) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    info = json.loads((reach.video / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == FPS and info["total_episodes"] == EPISODES
    assert {k: info["features"][k]["dtype"] for k in (TOP, WRIST, "observation.state", "action")} == {
        TOP: "video", WRIST: "video", "observation.state": "float32", "action": "float32"}
    assert info["features"][TOP]["info"]["video.codec"] == "av1"
    ds = LeRobotDataset("local/check", root=reach.video, video_backend="pyav")
    assert len(ds) == info["total_frames"] == reach.starts[-1]
    assert set(ds.meta.tasks.index) == {e.task for e in reach.episodes}
    i = 0
    for ep, episode in enumerate(reach.episodes):
        for t in range(len(episode)):
            item = ds[i]
            assert (int(item["episode_index"]), int(item["frame_index"]), item["task"]) == (ep, t, episode.task)
            assert torch.equal(item["observation.state"], torch.from_numpy(episode.states[t]))
            assert torch.equal(item["action"], torch.from_numpy(episode.actions[t]))
            for camera, key in zip(CAMERAS, (TOP, WRIST), strict=True):  # AV1 is lossy: near, and nearest
                frames = episode.images[camera]
                error = (item[key] - _chw(frames[t])).abs().mean().item()
                assert error < 0.05, (ep, t, camera, error)
                if t + 1 < len(episode) and camera == "wrist":  # the egocentric view changes at every step
                    assert error < (item[key] - _chw(frames[t + 1])).abs().mean().item()
            i += 1
    # PNG images come back exactly
    image_ds = LeRobotDataset("local/check_image", root=reach.image)
    assert json.loads((reach.image / "meta" / "info.json").read_text())["features"][TOP]["dtype"] == "image"
    for i in range(len(image_ds)):
        ep = int(image_ds[i]["episode_index"])
        t = i - reach.starts[ep]
        for camera, key in zip(CAMERAS, (TOP, WRIST), strict=True):
            assert torch.equal(image_ds[i][key], _chw(reach.episodes[ep].images[camera][t]))


def test_stats_file_matches_the_recorded_frames(reach: SimpleNamespace) -> None:
    stats = json.loads((reach.video / "meta" / "stats.json").read_text())
    for key, values in (("action", [a for e in reach.episodes for a in e.actions]),
                        ("observation.state", [s for e in reach.episodes for s in e.states])):
        x = np.stack(values).astype(np.float64)
        s = {name: np.asarray(v, dtype=np.float64) for name, v in stats[key].items()}
        np.testing.assert_allclose(s["mean"], x.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s["std"], x.std(0), rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(s["min"], x.min(0).astype(np.float32))
        np.testing.assert_array_equal(s["max"], x.max(0).astype(np.float32))
        assert int(np.asarray(s["count"]).item()) == len(x)
        ordered = np.stack([s["min"], s["q01"], s["q10"], s["q50"], s["q90"], s["q99"], s["max"]])
        assert (np.diff(ordered, axis=0) >= -1e-6).all()
    # image stats: per channel [3, 1, 1] in [0, 1], from frames lerobot samples: near the mean of all frames
    all_top = np.stack([f for e in reach.episodes for f in e.images["top"]]).astype(np.float64) / 255
    mean = np.asarray(stats[TOP]["mean"])
    assert mean.shape == (3, 1, 1)
    np.testing.assert_allclose(mean[:, 0, 0], all_top.mean((0, 1, 2)), atol=0.02)


def test_ensure_writes_once_and_atomically(reach: SimpleNamespace, tmp_path: Path) -> None:
    info = reach.video / "meta" / "info.json"
    before = info.stat().st_mtime_ns
    assert ensure_reach_dataset(reach.cache, num_episodes=EPISODES, seed=0, progress=False) == reach.video
    assert info.stat().st_mtime_ns == before
    assert reach.video.name == reach_dataset_name(num_episodes=EPISODES, seed=0)
    # two writers at once (as several ranks would be): one complete copy, no temporary folder left
    barrier, results, errors = threading.Barrier(2), [], []

    def write() -> None:
        barrier.wait()
        try:
            results.append(ensure_reach_dataset(tmp_path, num_episodes=1, seed=3, use_videos=False, progress=False))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [results[0].name]
    ds = VLADataset(results[0], chunk_size=2)
    assert ds.num_episodes == 1 and len(ds) == len(next(expert_episodes(1, seed=3)))


def test_chunks_and_padding_equal_lerobot_and_the_episodes(reach: SimpleNamespace) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = VLADataset(reach.video, chunk_size=CHUNK, n_obs_steps=2)
    steps = [round(t / FPS, 6) for t in range(CHUNK)]
    assert {k: [round(x, 6) for x in v] for k, v in ds.delta_timestamps.items()} == {
        "action": steps, "observation.state": [-0.1, 0.0], TOP: [-0.1, 0.0], WRIST: [-0.1, 0.0]}
    ref = LeRobotDataset("local/ref", root=reach.video, delta_timestamps=ds.delta_timestamps, video_backend="pyav")
    assert (ds.state_dim, ds.action_dim, ds.fps, ds.camera_keys) == (2, 2, FPS, [TOP, WRIST])
    for ep, episode in enumerate(reach.episodes):
        n = len(episode)
        for t in sorted({0, 1, n - 3, n - 2, n - 1}):
            sample, theirs = ds[reach.starts[ep] + t], ref[reach.starts[ep] + t]
            for key, value in sample.items():
                assert torch.equal(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key]
            want = np.stack([episode.actions[min(t + k, n - 1)] for k in range(CHUNK)])
            assert torch.equal(sample["action"], torch.from_numpy(want))
            assert sample["action_is_pad"].tolist() == [t + k >= n for k in range(CHUNK)]
            history = np.stack([episode.states[max(t - 1, 0)], episode.states[t]])
            assert torch.equal(sample["observation.state"], torch.from_numpy(history))
            for key in ("observation.state", TOP, WRIST):
                assert sample[f"{key}_is_pad"].tolist() == [t == 0, False]
            assert sample[WRIST].shape == (2, 3, 64, 64) and sample["task"] == episode.task
    # a subset of episodes reads just those
    subset = VLADataset(reach.video, chunk_size=CHUNK, episodes=[1, 3])
    assert len(subset) == len(reach.episodes[1]) + len(reach.episodes[3]) and subset.num_episodes == 2
    last = subset[len(subset) - 1]
    assert (int(last["episode_index"]), last["action_is_pad"].tolist()) == (3, [False] + [True] * (CHUNK - 1))


def test_dataloader_batches(reach: SimpleNamespace) -> None:
    ds = VLADataset(reach.video, chunk_size=CHUNK)
    loader = make_dataloader(ds, batch_size=4, shuffle=False, num_workers=2)
    batches = list(loader)
    assert len(batches) == math.ceil(len(ds) / 4)
    first = batches[0]
    assert set(first) == {TOP, WRIST, "observation.state", "action", "action_is_pad", "task", "episode_index",
                          "frame_index", "index"}
    for key in (TOP, WRIST):
        assert first[key].shape == (4, 3, 64, 64) and first[key].dtype == torch.float32
        assert 0 <= first[key].min() and first[key].max() <= 1
    assert first["observation.state"].shape == (4, 2) and first["action"].shape == (4, CHUNK, 2)
    assert first["action_is_pad"].shape == (4, CHUNK) and first["action_is_pad"].dtype == torch.bool
    assert first["task"] == [reach.episodes[0].task] * 4
    direct = collate_vla([ds[i] for i in range(4, 8)])  # workers decode exactly what the dataset does, in order
    for key, value in batches[1].items():
        assert torch.equal(value, direct[key]) if isinstance(value, torch.Tensor) else value == direct[key]
    assert torch.cat([b["index"] for b in batches]).tolist() == list(range(len(ds)))

    def order(seed: int) -> list[int]:
        return [i for batch in make_dataloader(ds, batch_size=8, seed=seed).batch_sampler for i in batch]

    assert order(0) == order(0) != order(1) and sorted(order(0)) == list(range(len(ds)))


def test_normalisation_matches_the_stats_and_round_trips(reach: SimpleNamespace) -> None:
    ds = VLADataset(reach.video, chunk_size=CHUNK)
    batch = collate_vla([ds[i] for i in range(0, len(ds), 5)])
    original = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    stats = json.loads((reach.video / "meta" / "stats.json").read_text())
    formulas = {
        "MEAN_STD": lambda x, s: (x - s["mean"]) / (s["std"] + 1e-8),
        "MIN_MAX": lambda x, s: 2 * (x - s["min"]) / (s["max"] - s["min"]) - 1,
        "QUANTILES": lambda x, s: 2 * (x - s["q01"]) / (s["q99"] - s["q01"]) - 1,
        "QUANTILE10": lambda x, s: 2 * (x - s["q10"]) / (s["q90"] - s["q10"]) - 1,
    }
    for mode, formula in formulas.items():
        norm = Normalizer.from_dataset(ds, {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode})
        out = norm.normalize(batch)
        for key in ("observation.state", "action"):
            s = {name: torch.tensor(v, dtype=torch.float64) for name, v in stats[key].items()}
            want = formula(batch[key].double(), s).float()
            torch.testing.assert_close(out[key], want, atol=1e-5, rtol=1e-5)
        # (the expert's actions are clipped to [-1, 1] and reach both ends, so MIN_MAX leaves them as they are)
        assert not torch.allclose(out["observation.state"], batch["observation.state"])
        back = norm.unnormalize(out)
        for key in ("observation.state", "action"):
            torch.testing.assert_close(back[key], batch[key], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(norm.unnormalize_action(out["action"]), batch["action"], atol=1e-5, rtol=1e-5)
        assert torch.equal(out[TOP], batch[TOP]) and out["task"] == batch["task"]
        assert torch.equal(out["action_is_pad"], batch["action_is_pad"])
    for key, value in original.items():  # normalize returns a copy; the batch is untouched
        assert torch.equal(batch[key], value) if isinstance(value, torch.Tensor) else batch[key] == value
    # images by MEAN_STD: per channel, with the [3, 1, 1] statistics
    out = Normalizer.from_dataset(ds, {"VISUAL": "MEAN_STD"}).normalize(batch)
    s = {name: torch.tensor(stats[TOP][name], dtype=torch.float64) for name in ("mean", "std")}
    torch.testing.assert_close(out[TOP], ((batch[TOP].double() - s["mean"]) / (s["std"] + 1e-8)).float(),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(out["action"], batch["action"])  # ACTION left out: IDENTITY


def test_normaliser_errors(reach: SimpleNamespace, tmp_path: Path) -> None:
    ds = VLADataset(reach.video, chunk_size=2)
    features = {"action": ds.meta.features["action"]}
    with pytest.raises(LoongError, match="unknown mode 'ZSCORE'; known: IDENTITY, MEAN_STD"):
        Normalizer(ds.stats, features, {"ACTION": "ZSCORE"})
    with pytest.raises(LoongError, match="unknown feature type 'POSE'"):
        Normalizer(ds.stats, features, {"POSE": "MEAN_STD"})
    no_quantiles = {"action": {k: v for k, v in ds.stats["action"].items() if k != "q01"}}
    with pytest.raises(LoongError, match="'action' has no q01 \\(needed by QUANTILES\\)"):
        Normalizer(no_quantiles, features, {"ACTION": "QUANTILES"}, source="x/meta/stats.json")
    with pytest.raises(LoongError, match="no statistics for 'action', which is normalised by MIN_MAX"):
        Normalizer({"observation.state": ds.stats["observation.state"]}, features, {"ACTION": "MIN_MAX"})
    assert Normalizer(None, features, {"ACTION": "IDENTITY"}).unnormalize_action(torch.ones(2)).tolist() == [1, 1]
    root = _copy(reach.video, tmp_path / "no_stats")
    (root / "meta" / "stats.json").unlink()
    with pytest.raises(LoongError, match=f"{root}/meta/stats.json: missing; 'action' is normalised by MEAN_STD"):
        Normalizer.from_dataset(VLADataset(root, chunk_size=2), {"ACTION": "MEAN_STD"})


def test_bad_folders_keys_and_files(reach: SimpleNamespace, tmp_path: Path) -> None:
    with pytest.raises(LoongError, match="no such folder"):
        VLADataset(tmp_path / "absent", chunk_size=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoongError, match="not a LeRobotDataset folder \\(it has no meta/info.json\\)"):
        VLADataset(tmp_path / "empty", chunk_size=2)
    old = _copy(reach.video, tmp_path / "old")
    info = json.loads((old / "meta" / "info.json").read_text())
    (old / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v2.1"}))
    with pytest.raises(LoongError, match="codebase_version v2.1; Loong reads LeRobotDataset v3"):
        VLADataset(old, chunk_size=2)
    with pytest.raises(LoongError, match="no feature 'observation.joints'.*its features: observation.images.top, "
                                         "observation.images.wrist, observation.state, action"):
        VLADataset(reach.video, chunk_size=2, state_key="observation.joints")
    with pytest.raises(LoongError, match="no feature 'observation.images.front'"):
        VLADataset(reach.video, chunk_size=2, cameras=["observation.images.front"])
    with pytest.raises(LoongError, match="'action' is a float32, not a camera"):
        VLADataset(reach.video, chunk_size=2, cameras=["action"])
    with pytest.raises(LoongError, match="chunk_size: must be an int >= 1"):
        VLADataset(reach.video, chunk_size=0)
    with pytest.raises(LoongError, match="episodes: \\[7\\] must be a non-empty list of episode indices 0..5"):
        VLADataset(reach.video, chunk_size=2, episodes=[7])
    # missing files fail before lerobot sees the folder (it would go to the Hub for them)
    for relative in ("videos/observation.images.wrist/chunk-000/file-000.mp4", "data/chunk-000/file-000.parquet"):
        root = _copy(reach.video, tmp_path / relative.split("/")[0])
        (root / relative).unlink()
        with pytest.raises(LoongError, match=f"{root}: missing episode files: {relative} \\(episodes 0-5\\)"):
            VLADataset(root, chunk_size=2)


def test_corrupt_video_and_shape_disagreeing_with_info(reach: SimpleNamespace, tmp_path: Path) -> None:
    root = _copy(reach.video, tmp_path / "truncated")
    video = root / "videos" / "observation.images.wrist" / "chunk-000" / "file-000.mp4"
    video.write_bytes(video.read_bytes()[: video.stat().st_size * 2 // 5])
    ds = VLADataset(root, chunk_size=2)
    with pytest.raises(LoongError, match=re.escape(f"{video}: the video of 'observation.images.wrist' for episode "
                                                   f"{EPISODES - 1} cannot be decoded (")):
        ds[len(ds) - 1]
    assert ds[0]["observation.images.wrist"].shape == (3, 64, 64)  # frames before the cut still decode
    ends = [(s - reach.starts[0]) / FPS for s in reach.starts]  # each episode's span in the concatenated file
    assert probe_video(reach.video / video.relative_to(root), ends[-2], ends[-1] - 1 / FPS) is None
    assert probe_video(video, ends[0], ends[1] - 1 / FPS) is None
    assert probe_video(video, ends[-2], ends[-1] - 1 / FPS) is not None
    root = _copy(reach.video, tmp_path / "reshaped")
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"][TOP]["shape"] = [32, 32, 3]
    (root / "meta" / "info.json").write_text(json.dumps(info))
    message = (f"{root}: '{TOP}' of episode 0 frame 0 has shape \\[3, 64, 64\\], but meta/info.json declares one "
               "of \\[3, 32, 32\\]")
    reshaped = VLADataset(root, chunk_size=2)
    with pytest.raises(LoongError, match=message):
        reshaped[0]
    # raised in a DataLoader worker, the error reaches the training process whole
    with pytest.raises(LoongError, match=message):
        next(iter(make_dataloader(reshaped, batch_size=2, shuffle=False, num_workers=1, timeout=60)))


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getscheduler"), reason="Linux scheduling calls")
def test_writing_videos_leaves_the_scheduling_policy_as_it_was(tmp_path: Path) -> None:
    """SVT-AV1 makes the thread that encodes ``SCHED_FIFO`` 99 when run as root (it was: every later gloo launch of
    the test run inherited it and livelocked); the writer puts the policy back, and :func:`keep_scheduling` restores
    what a block changed."""
    import os

    from loong.embodied.data.synthetic import keep_scheduling, write_reach_dataset

    before = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
    write_reach_dataset(tmp_path / "video", num_episodes=1, image_size=32, progress=False)
    assert (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority) == before
    if os.geteuid() == 0 and before[0] == os.SCHED_OTHER:  # only root may raise a thread to real time
        with keep_scheduling():
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
            assert os.sched_getscheduler(0) == os.SCHED_FIFO
        assert (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority) == before
