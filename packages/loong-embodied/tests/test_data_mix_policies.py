"""A mix of two datasets through the policies: each sample normalised with its own source's statistics (the oracle:
the same arithmetic by hand from each dataset's ``meta/stats.json``), GR00T's per-embodiment heads picked by the
source's embodiment id (the oracle: the same samples with the id set by hand), ``loong-embodied train`` on
``data.repo_root=[a,b]`` for the tiny Pi0.5 and GR00T N1.7 with the saved policy folder loading into inference for
each source, and bad mixes exiting 2 with the dotted key.

The two datasets are the synthetic reach task (PNG frames): ``a`` the expert's actions, ``b`` another seed with the
actions scaled by 3 (so its action statistics differ from ``a``'s by about 3x).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loong.core.errors import LoongError
from loong.embodied.data.dataset import collate_vla
from loong.embodied.data.mix import build_mixture
from loong.embodied.data.normalize import SOURCES_FILE
from loong.embodied.data.synthetic import write_reach_dataset
from loong.embodied.policies import POLICIES

sys.path.insert(0, str(Path(__file__).parent))
from data_testing import write_tiny_dataset  # noqa: E402

SCALE = 3.0


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    base = tmp_path_factory.mktemp("mixpol")
    a = write_reach_dataset(base / "reach_a", num_episodes=3, seed=0, use_videos=False, progress=False)
    b = write_reach_dataset(base / "reach_b", num_episodes=2, seed=1, use_videos=False, progress=False,
                            action_scale=SCALE)
    wide = write_tiny_dataset(base / "wide", state_dim=3, action_dim=4, cameras=["top", "wrist"], lengths=[4],
                              tag=0, image_size=64)
    stats = [json.loads((Path(r) / "meta" / "stats.json").read_text()) for r in (a, b)]
    return SimpleNamespace(a=Path(a), b=Path(b), wide=Path(wide), stats=stats, base=base)


def _config(name: str, chunk: int = 4):
    spec = POLICIES.get(name)
    return spec, spec.presets["tiny"].replace(chunk_size=chunk, n_action_steps=chunk)


def _batch(mixture, picks: list[tuple[int, int]]) -> dict:
    return collate_vla([mixture[p] for p in picks])


def _quantile(x: torch.Tensor, st: dict) -> torch.Tensor:
    lo, hi = torch.tensor(st["q01"]), torch.tensor(st["q99"])
    return 2 * (x - lo) / (hi - lo + 1e-8) - 1


def _minmax(x: torch.Tensor, st: dict) -> torch.Tensor:
    lo, hi = torch.tensor(st["min"]), torch.tensor(st["max"])
    return (2 * (x - lo) / (hi - lo) - 1).clamp(-1, 1)


PICKS = [(0, 0), (1, 0), (0, 5), (1, 7), (1, 2)]


def test_the_two_sources_have_different_action_statistics(data: SimpleNamespace) -> None:
    qa, qb = (np.asarray(s["action"]["q99"]) - np.asarray(s["action"]["q01"]) for s in data.stats)
    assert np.all(np.abs(qb - qa) > 0.2 * qa)  # else the per-source oracle below could not tell the sources apart


@pytest.mark.parametrize("name", ["pi05", "groot_n1_7", "groot_n1_6"])
def test_each_sample_is_normalised_with_its_own_sources_statistics(data: SimpleNamespace, name: str,
                                                                    tmp_path: Path) -> None:
    spec, config = _config(name)
    mixture = build_mixture([data.a, data.b], [0.7, 0.3], chunk_size=config.chunk_size)
    processor = spec.processor_class.from_datasets(config, mixture.sources, mixture.embodiment_ids)
    raw = _batch(mixture, PICKS)
    out = processor(raw)
    norm = _quantile if name == "pi05" else _minmax
    action_key = "actions" if name == "pi05" else "action"
    for row, (source, _) in enumerate(PICKS):
        st = data.stats[source]
        expected = norm(raw["action"][row], st["action"])
        got = out[action_key][row, :, :2]
        if name != "pi05":  # GR00T zeroes padded steps
            expected = expected * (~raw["action_is_pad"][row]).unsqueeze(-1)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        other = norm(raw["action"][row], data.stats[1 - source]["action"])
        assert not torch.allclose(got, other, atol=1e-3)
        if name != "pi05":
            torch.testing.assert_close(out["state"].reshape(len(PICKS), -1)[row, :2],
                                       norm(raw["observation.state"][row], st["observation.state"]))
    if name != "pi05":
        assert out["embodiment_id"].tolist() == [s for s, _ in PICKS]
    # saved and loaded: the same outputs, the sources recorded, the inverse per source
    processor.save(tmp_path)
    sources = json.loads((tmp_path / SOURCES_FILE).read_text())["sources"]
    assert [s["root"] for s in sources] == [str(data.a), str(data.b)]
    assert [s["embodiment_id"] for s in sources] == [0, 1]
    loaded = spec.processor_class.load(tmp_path, config)
    again = loaded(raw)
    torch.testing.assert_close(again[action_key], out[action_key])
    back = loaded.postprocess(out[action_key][1:2], source=1)[0]
    valid = ~raw["action_is_pad"][1]
    torch.testing.assert_close(back[valid], raw["action"][1][valid], atol=1e-4, rtol=1e-4)


def test_one_dataset_keeps_its_saved_format(data: SimpleNamespace, tmp_path: Path) -> None:
    for name in ("pi05", "groot_n1_7"):
        spec, config = _config(name)
        mixture = build_mixture([data.a], chunk_size=config.chunk_size)
        processor = spec.processor_class.from_datasets(config, mixture.sources)
        processor.save(tmp_path / name)
        assert not (tmp_path / name / SOURCES_FILE).exists()
        assert sorted(p.name for p in (tmp_path / name).iterdir() if "stats" in p.name) == (
            ["pi05_stats.safetensors"] if name == "pi05" else [])


def test_groot_routes_each_sample_to_its_embodiments_heads(data: SimpleNamespace) -> None:
    spec, config = _config("groot_n1_7")
    torch.manual_seed(0)
    policy = spec.policy_class(config).eval()
    mixture = build_mixture([data.a, data.b], chunk_size=config.chunk_size, embodiment_ids=[3, 7])
    mix_processor = spec.processor_class.from_datasets(config, mixture.sources, mixture.embodiment_ids)
    picks = [(1, 0), (1, 4), (1, 9)]
    inputs = mix_processor(_batch(mixture, picks))
    assert inputs["embodiment_id"].tolist() == [7, 7, 7]
    # the same samples through a processor of dataset b alone, the embodiment id set by hand
    alone = spec.processor_class.from_dataset(mixture.sources[1], config)
    raw = collate_vla([mixture.sources[1][mixture.frames[1].row(k)] for _, k in picks])
    noise = torch.randn(len(picks), config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(1))
    time = torch.tensor([0.2, 0.5, 0.8])
    by_hand = alone({**raw, "embodiment_id": torch.full((3,), 7)})
    with torch.no_grad():
        loss_mix = policy.loss(inputs, noise=noise, time=time)[0]
        loss_hand = policy.loss(by_hand, noise=noise, time=time)[0]
        loss_other = policy.loss({**by_hand, "embodiment_id": torch.full((3,), 3)}, noise=noise, time=time)[0]
    torch.testing.assert_close(loss_mix, loss_hand)
    assert not torch.allclose(loss_mix, loss_other)  # the routing matters: another row gives another loss


def test_bad_mixes_are_refused_naming_both_datasets(data: SimpleNamespace) -> None:
    spec, config = _config("pi05")
    mixture = build_mixture([data.a, data.wide], chunk_size=config.chunk_size)
    with pytest.raises(LoongError, match=r"data.repo_root: Pi0.5 has one action space.*reach_a.*state 2 / action "
                                         r"2.*wide.*state 3 / action 4"):
        spec.processor_class.from_datasets(config, mixture.sources)
    spec, config = _config("groot_n1_7")
    with pytest.raises(LoongError, match=r"data.repo_root: groot_n1_7 mixes datasets of one state/action width"):
        spec.processor_class.from_datasets(config, mixture.sources)


# ---- the command line ----------------------------------------------------------------------------------------
TRAIN = ["train.steps=3", "train.progress=false", "train.eval_interval=0", "train.eval_iters=0",
         "train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1",
         "model.config.chunk_size=4", "model.config.n_action_steps=4"]


def _main(*argv: str) -> tuple[int, str]:
    from loong.embodied.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("option", ["pi05_tiny", "groot_n1_7_tiny"])
def test_train_on_a_mix_and_infer_for_each_source(data: SimpleNamespace, option: str, tmp_path: Path) -> None:
    from loong.embodied.inference import PolicyRunner, load_policy

    out = tmp_path / "out"
    extra = ["data.embodiment_ids=[10,4]"] if option.startswith("groot") else []
    rc, log = _main("train", f"policy={option}", f"output_dir={out}", f"data.repo_root=[{data.a},{data.b}]",
                    "data.weights=[0.7,0.3]", *TRAIN, *extra)
    assert rc == 0, log[-4000:]
    assert "share 0.700" in log and "share 0.300" in log
    (run_dir,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    sources = json.loads((run_dir / "policy" / SOURCES_FILE).read_text())["sources"]
    assert [s["name"] for s in sources] == ["reach_a", "reach_b"]
    loaded = load_policy(run_dir, device="cpu")
    sample = build_mixture([data.b], chunk_size=4).sources[0][0]
    observation = {k: (v.permute(1, 2, 0).numpy() * 255).astype(np.uint8) for k, v in sample.items()
                   if k.startswith("observation.images.")}
    observation["observation.state"] = sample["observation.state"].numpy()
    observation["task"] = sample["task"]
    chunks = {}
    for source in (0, "reach_b", str(data.b)):
        runner = PolicyRunner(loaded, seed=0, source=source)
        chunks[source] = runner.predict_chunk(observation)
        assert chunks[source].shape == (4, 2) and np.isfinite(chunks[source]).all()
    np.testing.assert_array_equal(chunks["reach_b"], chunks[str(data.b)])
    # the oracle for source 1: the policy's normalised chunk unnormalised by hand with b's statistics
    runner = PolicyRunner(loaded, seed=0, source=1)
    inputs = loaded.processor(runner.raw_batch(observation), train=False)
    with torch.no_grad():
        chunk = loaded.policy.predict_action_chunk(inputs, noise=runner._noise())[0, :, :2]
    st = data.stats[1]["action"]
    if option.startswith("pi05"):
        lo, hi = torch.tensor(st["q01"]), torch.tensor(st["q99"])
        expected = (chunk + 1) / 2 * (hi - lo + 1e-8) + lo
    else:
        lo, hi = torch.tensor(st["min"]), torch.tensor(st["max"])
        expected = (chunk.clamp(-1, 1) + 1) / 2 * (hi - lo) + lo
        assert inputs["embodiment_id"].tolist() == [4]
    np.testing.assert_allclose(chunks["reach_b"], expected.numpy(), atol=1e-4, rtol=1e-4)
    assert not np.allclose(chunks[0], chunks["reach_b"])


@pytest.mark.parametrize(("argv", "expected"), [
    (["data.embodiment_ids=[1]"], "data.embodiment_ids=[1]: one id per dataset of data.repo_root (2 datasets)"),
    (["data.weights=[0.5]"], "data.weights=[0.5]: one weight per dataset of data.repo_root (2 datasets)"),
    (["policy=groot_n1_7_tiny", "data.embodiment_ids=[1,32]"],
     "data.embodiment_ids[1]=32: must be below model.config.num_embodiments (32)"),
    (["data.embodiment_ids=[0,1]"], "data.embodiment_ids=[0, 1]: this policy has no per-embodiment heads"),
])
def test_bad_mix_keys_exit_2(data: SimpleNamespace, tmp_path: Path, argv: list[str], expected: str) -> None:
    out = tmp_path / "out"
    rc, log = _main("train", f"output_dir={out}", f"data.repo_root=[{data.a},{data.b}]", *TRAIN, *argv)
    assert rc == 2, log[-3000:]
    assert expected in log
    assert not out.exists() or not any(p for p in out.iterdir() if not p.name.startswith("."))


def test_a_mix_of_different_dims_exits_2(data: SimpleNamespace, tmp_path: Path) -> None:
    rc, log = _main("train", f"output_dir={tmp_path / 'out'}", f"data.repo_root=[{data.a},{data.wide}]", *TRAIN)
    assert rc == 2, log[-3000:]
    assert "data.repo_root: Pi0.5 has one action space" in log and "reach_a" in log and "wide" in log
