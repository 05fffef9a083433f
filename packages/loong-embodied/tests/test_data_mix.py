"""The mixture of several LeRobotDatasets (uniform samples across widths and cameras, embodiment ids, per-source
normalisation, episode-aware frames, bad data) and its seeded sample stream (weights, epochs, resume, DP slices).

The datasets are tiny PNG LeRobotDatasets written once per module by lerobot's own writer (``data_testing``):
every frame's state names its source, episode and frame, which is the oracle for what each sample must hold.
"""

from __future__ import annotations

import collections
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loong.core.errors import LoongError
from loong.embodied.data.dataset import VLADataset, collate_vla
from loong.embodied.data.mix import build_mixture, mask_key
from loong.embodied.data.sampler import MixtureStream, RankBatches

sys.path.insert(0, str(Path(__file__).parent))
from data_testing import frame_code, write_tiny_dataset  # noqa: E402

TOP, WRIST = "observation.images.top", "observation.images.wrist"
CHUNK = 3
A_LENGTHS, B_LENGTHS = [5, 7], [6, 4, 3]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A: state 2, action 2, cameras top + wrist; B: state 3, action 4, camera top only; C: like A but 8² top
    images and one data file per episode."""
    base = tmp_path_factory.mktemp("mix")
    a = write_tiny_dataset(base / "a", state_dim=2, action_dim=2, cameras=["top", "wrist"], lengths=A_LENGTHS, tag=0)
    b = write_tiny_dataset(base / "b", state_dim=3, action_dim=4, cameras=["top"], lengths=B_LENGTHS, tag=1000)
    c = write_tiny_dataset(base / "c", state_dim=2, action_dim=2, cameras=["top"], lengths=[3, 4], tag=2000,
                           image_size=8, file_per_episode=True)
    return SimpleNamespace(a=a, b=b, c=c, tags=[0, 1000])


def _same(x: object, y: object) -> bool:
    return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_samples_are_uniform_across_widths_and_cameras(data: SimpleNamespace) -> None:
    mixture = build_mixture([data.a, data.b], chunk_size=CHUNK)
    assert (mixture.state_dim, mixture.action_dim, mixture.state_dims, mixture.action_dims) == (3, 4, [2, 3], [2, 4])
    assert mixture.camera_keys == [TOP, WRIST] and mixture.embodiment_ids == [0, 1]
    assert len(mixture) == sum(A_LENGTHS) + sum(B_LENGTHS)
    plain = [VLADataset(data.a, chunk_size=CHUNK), VLADataset(data.b, chunk_size=CHUNK)]
    keys = None
    for source, ds in enumerate(plain):
        for k in range(len(ds)):
            sample, raw = mixture[(source, k)], ds[k]
            keys = keys or list(sample)
            assert list(sample) == keys  # one key set and order: any mix of sources collates
            ep, t = int(raw["episode_index"]), int(raw["frame_index"])
            assert sample["observation.state"][0] == frame_code(data.tags[source], ep, t)
            s, a = ds.state_dim, ds.action_dim
            assert torch.equal(sample["observation.state"][:s], raw["observation.state"])
            assert torch.equal(sample["action"][:, :a], raw["action"])
            assert not sample["observation.state"][s:].any() and not sample["action"][:, a:].any()
            assert sample[mask_key("observation.state")].tolist() == [i < s for i in range(3)]
            assert sample[mask_key("action")].tolist() == [i < a for i in range(4)]
            assert torch.equal(sample[TOP], raw[TOP]) and sample[mask_key(TOP)].item() is True
            if source == 0:
                assert torch.equal(sample[WRIST], raw[WRIST]) and sample[mask_key(WRIST)].item() is True
            else:  # B has no wrist camera: a zero image and mask 0
                assert sample[WRIST].shape == (3, 16, 16) and not sample[WRIST].any()
                assert sample[mask_key(WRIST)].item() is False
            for key in ("action_is_pad", "episode_index", "frame_index", "index", "task"):
                assert _same(sample[key], raw[key])
            assert (sample["embodiment_id"].item(), sample["dataset_index"].item()) == (source, source)
            assert sample["embodiment_id"].dtype == torch.int64
    # flat indices run over A's frames then B's
    assert mixture[sum(A_LENGTHS)]["observation.state"][0].item() == frame_code(1000, 0, 0)
    batch = collate_vla([mixture[(1, 0)], mixture[(0, 3)], mixture[(1, 5)]])
    assert batch["observation.state"].shape == (3, 3) and batch["action"].shape == (3, CHUNK, 4)
    assert batch[mask_key(WRIST)].tolist() == [False, True, False]
    assert batch[mask_key("action")].tolist() == [[True] * 4, [True, True, False, False], [True] * 4]
    assert batch["embodiment_id"].tolist() == [1, 0, 1]
    # embodiment ids from the config: a list, or a mapping by root
    assert build_mixture([data.a, data.b], chunk_size=CHUNK, embodiment_ids=[5, 9]).embodiment_ids == [5, 9]
    by_root = build_mixture([data.a, data.b], chunk_size=CHUNK, embodiment_ids={str(data.b): 7, str(data.a): 3})
    assert by_root.embodiment_ids == [3, 7] and by_root[(1, 2)]["embodiment_id"].item() == 7
    # a camera chosen by the config: present in A only
    wrist_only = build_mixture([data.a, data.b], chunk_size=CHUNK, cameras=[WRIST])
    assert wrist_only.camera_keys == [WRIST] and TOP not in wrist_only[(0, 0)]
    assert wrist_only[(0, 0)][mask_key(WRIST)].item() and not wrist_only[(1, 0)][mask_key(WRIST)].item()


def test_history_of_a_missing_camera_is_all_padding(data: SimpleNamespace) -> None:
    mixture = build_mixture([data.a, data.b], chunk_size=CHUNK, n_obs_steps=2)
    a, b = mixture[(0, 1)], mixture[(1, 1)]
    assert list(a) == list(b)
    assert b[WRIST].shape == (2, 3, 16, 16) and b[f"{WRIST}_is_pad"].tolist() == [True, True]
    assert a[f"{WRIST}_is_pad"].tolist() == [False, False] and b[f"{TOP}_is_pad"].tolist() == [False, False]
    assert b["observation.state"].shape == (2, 3) and b["observation.state_is_pad"].tolist() == [False, False]
    assert mixture[(1, 0)]["observation.state_is_pad"].tolist() == [True, False]


def test_each_source_normalises_with_its_own_stats(data: SimpleNamespace) -> None:
    norm_map = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "QUANTILES"}
    mixture = build_mixture([data.a, data.b], chunk_size=CHUNK, norm_map=norm_map)
    raw = build_mixture([data.a, data.b], chunk_size=CHUNK)
    for source, root in enumerate((data.a, data.b)):
        stats = json.loads((root / "meta" / "stats.json").read_text())
        st = {k: torch.tensor(v, dtype=torch.float64) for k, v in stats["observation.state"].items()}
        ac = {k: torch.tensor(v, dtype=torch.float64) for k, v in stats["action"].items()}
        s, a = mixture.state_dims[source], mixture.action_dims[source]
        for k in (0, 4, 9):
            out, x = mixture[(source, k)], raw[(source, k)]
            want_state = ((x["observation.state"][:s].double() - st["mean"]) / (st["std"] + 1e-8)).float()
            want_action = (2 * (x["action"][:, :a].double() - ac["q01"]) / (ac["q99"] - ac["q01"]) - 1).float()
            torch.testing.assert_close(out["observation.state"][:s], want_state, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out["action"][:, :a], want_action, atol=1e-5, rtol=1e-5)
            assert not out["observation.state"][s:].any() and not out["action"][:, a:].any()  # 0 after normalising
            assert torch.equal(out[TOP], x[TOP])
    assert [n.stats["action"]["mean"].shape for n in mixture.normalizers] == [(2,), (4,)]


def test_camera_sizes_must_agree_or_be_resized(data: SimpleNamespace) -> None:
    with pytest.raises(LoongError, match=f"camera '{TOP}' has different shapes in the mixed datasets \\({data.a}: "
                                         f"\\[3, 16, 16\\]; {data.c}: \\[3, 8, 8\\]\\); give data.image_size"):
        build_mixture([data.a, data.c], chunk_size=CHUNK)
    mixture = build_mixture([data.a, data.c], chunk_size=CHUNK, image_size=(16, 16))
    small = VLADataset(data.c, chunk_size=CHUNK)[2][TOP]
    assert mixture[(1, 2)][TOP].shape == (3, 16, 16)
    want = torch.nn.functional.interpolate(small[None], size=(16, 16), mode="bilinear", antialias=True)[0]
    torch.testing.assert_close(mixture[(1, 2)][TOP], want)
    assert torch.equal(mixture[(0, 2)][TOP], VLADataset(data.a, chunk_size=CHUNK)[2][TOP])  # already 16²


def test_episode_aware_frames(data: SimpleNamespace) -> None:
    mixture = build_mixture([data.a, data.b], chunk_size=CHUNK, episodes=[None, [0, 2]], drop_first_frames=1,
                            drop_last_frames=2)
    read = [[(int(s["episode_index"]), int(s["frame_index"])) for s in (mixture[(src, k)] for k in range(len(f)))]
            for src, f in enumerate(mixture.frames)]
    assert read[0] == [(ep, t) for ep, n in enumerate(A_LENGTHS) for t in range(1, n - 2)]
    assert read[1] == [(ep, t) for ep in (0, 2) for t in range(1, B_LENGTHS[ep] - 2)]
    assert len(mixture) == len(read[0]) + len(read[1])
    # the stream draws from the usable frames only
    stream = mixture.stream(seed=0)
    assert sorted(zip(*stream.locate_range(0, len(mixture)), strict=True)) == sorted(
        (src, k) for src, f in enumerate(mixture.frames) for k in range(len(f)))
    with pytest.raises(LoongError, match=f"{data.b}: no frames left after dropping 0 first and 7 last frames"):
        build_mixture([data.b], chunk_size=CHUNK, drop_last_frames=7)


def test_stream_epochs_weights_and_determinism() -> None:
    # default weights: proportional to size, so an epoch reads every frame exactly once
    stream = MixtureStream([12, 13], seed=3)
    for e in (0, 1):
        sources, ks = stream.epoch(e)
        assert sorted(zip(sources.tolist(), ks.tolist(), strict=True)) == [(0, k) for k in range(12)] + [
            (1, k) for k in range(13)]
    assert stream.epoch(0)[0].tolist() != stream.epoch(1)[0].tolist()
    # weights: exact quotas per epoch, the shuffled order honours them in any stretch of the stream
    weighted = MixtureStream([10, 50], [3, 1], seed=0, epoch_size=400)
    assert weighted.quotas.tolist() == [300, 100]
    sources, ks = weighted.epoch(2)
    assert np.bincount(ks[sources == 0], minlength=10).tolist() == [30] * 10  # 30 passes over source 0
    assert sorted(collections.Counter(ks[sources == 1].tolist()).values()) == [2] * 50
    first = np.asarray(weighted.locate_range(1000, 200)[0])
    assert 0.65 < (first == 0).mean() < 0.85
    # a pure function of (seed, position): the same from a fresh stream, in any grouping, across epochs
    fresh = MixtureStream([10, 50], [3, 1], seed=0, epoch_size=400)
    whole = fresh.locate_range(350, 500)
    assert whole == weighted.locate_range(350, 500)
    assert [weighted.locate(p) for p in range(350, 850)] == list(zip(*whole, strict=True))
    assert MixtureStream([10, 50], [3, 1], seed=1, epoch_size=400).locate_range(350, 500) != whole
    with pytest.raises(LoongError, match="data.weights: 1 weights for 2 datasets"):
        MixtureStream([10, 50], [1])
    with pytest.raises(LoongError, match="must be finite, >= 0 and not all 0"):
        MixtureStream([10, 50], [1, -1])


def test_weights_are_honoured_by_a_mixture(data: SimpleNamespace) -> None:
    mixture = build_mixture([data.a, data.b], [0.8, 0.2], chunk_size=CHUNK)
    sources, _ = mixture.stream(seed=5).locate_range(0, 2000)
    assert abs(np.mean(np.asarray(sources) == 0) - 0.8) < 0.03
    ids = [mixture[key]["embodiment_id"].item() for key in
           zip(*mixture.stream(seed=5).locate_range(0, 50), strict=True)]
    assert ids == mixture.stream(seed=5).locate_range(0, 50)[0]


def test_rank_batches_partition_the_global_batch() -> None:
    stream = MixtureStream([7, 9, 4], [1, 2, 1], seed=0)
    whole = RankBatches(stream, batch_size=6, num_batches=5)
    ranks = [RankBatches(stream, batch_size=2, rank=r, world=3, num_batches=5) for r in range(3)]
    assert ranks[0].global_batch_size == 6
    for b, global_batch in enumerate(whole):
        assert [x for r in ranks for x in r.batch(b)] == global_batch
    # a start offset (any, not only a batch boundary) continues the stream
    flat = [x for batch in RankBatches(stream, batch_size=4, num_batches=10) for x in batch]
    tail = [x for batch in RankBatches(stream, batch_size=4, start_sample=7, num_batches=8) for x in batch]
    assert tail == flat[7:39]
    with pytest.raises(LoongError, match="rank 3 of world 3"):
        RankBatches(stream, batch_size=2, rank=3, world=3)


def test_configuration_errors(data: SimpleNamespace, tmp_path: Path) -> None:
    with pytest.raises(LoongError, match="data.on_error: must be one of fail, skip, got 'ignore'"):
        build_mixture([data.a], chunk_size=CHUNK, on_error="ignore")
    with pytest.raises(LoongError, match="data.weights: 3 weights for 2 datasets"):
        build_mixture([data.a, data.b], [1, 1, 1], chunk_size=CHUNK)
    with pytest.raises(LoongError, match=f"data.embodiment_ids: no id for {data.b}"):
        build_mixture([data.a, data.b], chunk_size=CHUNK, embodiment_ids={str(data.a): 0})
    with pytest.raises(LoongError, match="data.embodiment_ids: 1 ids for 2 datasets"):
        build_mixture([data.a, data.b], chunk_size=CHUNK, embodiment_ids=[4])
    with pytest.raises(LoongError, match="a dataset is named twice"):
        build_mixture([data.a, str(data.a)], chunk_size=CHUNK)
    with pytest.raises(LoongError, match="data.episodes: 1 lists for 2 datasets"):
        build_mixture([data.a, data.b], chunk_size=CHUNK, episodes=[[0]])
    with pytest.raises(LoongError, match="camera 'observation.images.front': none of the mixed datasets has it"):
        build_mixture([data.a, data.b], chunk_size=CHUNK, cameras=["observation.images.front"])
    with pytest.raises(LoongError, match=f"{tmp_path / 'absent'}: no such folder"):
        build_mixture([data.a, tmp_path / "absent"], chunk_size=CHUNK)
    # stats missing for a normalised key fail whatever on_error says
    root = Path(shutil.copytree(data.b, tmp_path / "no_stats"))
    (root / "meta" / "stats.json").unlink()
    with pytest.raises(LoongError, match=f"{root}/meta/stats.json: missing; 'observation.state' is normalised"):
        build_mixture([data.a, root], chunk_size=CHUNK, norm_map={"STATE": "MEAN_STD"}, on_error="skip")


def test_missing_episode_files_fail_or_are_left_out(data: SimpleNamespace, tmp_path: Path) -> None:
    root = Path(shutil.copytree(data.c, tmp_path / "c"))
    files = sorted((root / "data").rglob("*.parquet"))
    assert len(files) == 2  # one data file per episode
    files[0].unlink()
    relative = files[0].relative_to(root)
    with pytest.raises(LoongError, match=f"{root}: missing episode files: {relative} \\(episodes 0\\)"):
        build_mixture([data.a, root], chunk_size=CHUNK)
    mixture = build_mixture([data.a, root], chunk_size=CHUNK, on_error="skip", image_size=(16, 16))
    assert [(s.root, s.episode, s.row) for s in mixture.build_skipped] == [(str(root), 0, -1)]
    assert str(relative) in mixture.build_skipped[0].message
    assert mixture.sources[1].episodes == [1] and len(mixture.frames[1]) == 4
    assert {int(mixture[(1, k)]["episode_index"]) for k in range(4)} == {1}
    assert mixture[(1, 0)]["observation.state"][0] == frame_code(2000, 1, 0)
