"""Export and serving of a policy trained on a MIX (CPU, tiny GR00T N1.7, offline), one in-process run shared:
two synthetic reach datasets whose statistics differ (``b``'s actions scaled by 3), ``data.embodiment_ids=[5,7]``
(ids no lerobot tag names), ``train.save_lerobot=true train.save_lerobot_dataset=reach_b``.

- export: the lerobot folder carries the CHOSEN dataset's min/max statistics (oracle: that dataset's
  ``meta/stats.json``) and embodiment id (``train.save_lerobot_dataset=reach_b``: the second, the same folder byte
  for byte as ``convert --dataset-index 1`` of the run's checkpoint; ``convert`` without it: the first; both with a
  log line listing the choices); a bad index exits 2 with nothing written; ``train.save_lerobot_dataset`` resolves
  an index, a name or a folder as ``--dataset-index`` does (the same function);
- relocation: no absolute path in the folder; moved elsewhere it loads in lerobot 0.6.1 offline (from inside the
  folder, where lerobot resolves relative paths) with Loong's loss for that dataset's samples, and in Loong;
- serve: a client's ``embodiment_id`` reaches the per-embodiment heads end to end (openpi-client over the
  websocket), equal to ``predict_action_chunk`` for that id by hand and different from the other id's.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loong.embodied.data.synthetic import write_reach_dataset

sys.path.insert(0, str(Path(__file__).parent))
import groot_testing as gt  # noqa: E402

IDS = (5, 7)
TRAIN = ["policy=groot_n1_7_tiny", "train.steps=2", "train.progress=false", "train.eval_interval=0",
         "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1",
         "model.config.chunk_size=4", "model.config.n_action_steps=4", f"data.embodiment_ids=[{IDS[0]},{IDS[1]}]",
         "data.weights=[0.5,0.5]", "train.save_lerobot=true"]
COSMOS = "nvidia/Cosmos-Reason2-2B"


def _main(*argv: str) -> tuple[int, str]:
    from loong.embodied.cli import main

    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, out.getvalue()


def _seed_cosmos_processor(hf_home: Path) -> None:
    """lerobot's saved GR00T pipeline loads nvidia/Cosmos-Reason2-2B's processor: the tiny one, from this cache."""
    from transformers import Qwen3VLConfig

    from loong.embodied.policies.groot_n1_7.config import tiny
    from loong.embodied.policies.groot_n1_7.tiny_processor import save_tiny_processor

    def fill(snapshot: Path) -> None:
        save_tiny_processor(snapshot)
        Qwen3VLConfig(**tiny().backbone_dict()).save_pretrained(str(snapshot))

    gt.seed_hub_cache(hf_home, COSMOS, fill)


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory):
    import huggingface_hub.constants as hub_constants

    base = tmp_path_factory.mktemp("export_mix")
    a = write_reach_dataset(base / "reach_a", num_episodes=1, seed=0, use_videos=False, progress=False)
    b = write_reach_dataset(base / "reach_b", num_episodes=1, seed=1, use_videos=False, progress=False,
                            action_scale=3.0)
    with pytest.MonkeyPatch.context() as mp:  # this module's HF cache, restored for the next module
        hf_home = base / "hf_home"
        _seed_cosmos_processor(hf_home)
        mp.setenv("HF_HOME", str(hf_home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(hub_constants, "HF_HOME", str(hf_home))
        mp.setattr(hub_constants, "HF_HUB_CACHE", str(hf_home / "hub"))
        mp.setattr(hub_constants, "HF_HUB_OFFLINE", True)
        out = base / "runs"
        # the export's log line (pytest's own handlers keep records off stderr: a handler of this module's)
        records = io.StringIO()
        handler = logging.StreamHandler(records)
        export_logger = logging.getLogger("loong.embodied.lerobot_io")
        export_logger.addHandler(handler)
        try:
            rc, log = _main("train", f"output_dir={out}", f"data.repo_root=[{a},{b}]", *TRAIN,
                            "train.save_lerobot_dataset=reach_b")
        finally:
            export_logger.removeHandler(handler)
        assert rc == 0, log[-4000:]
        log += records.getvalue()
        (run_dir,) = [p for p in out.iterdir() if not p.name.startswith(".")]
        stats = [json.loads((Path(r) / "meta" / "stats.json").read_text()) for r in (a, b)]
        yield SimpleNamespace(base=base, run_dir=run_dir, stats=stats, roots=(Path(a), Path(b)), log=log)


def _lerobot_pipelines(folder: Path):
    from lerobot.configs import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.groot.processor_groot import (
        GrootActionUnpackUnnormalizeStep,
        GrootN17PackInputsStep,
    )

    config = PreTrainedConfig.from_pretrained(str(folder), local_files_only=True)
    pre, post = make_pre_post_processors(config, pretrained_path=str(folder))
    pack = next(s for s in pre.steps if isinstance(s, GrootN17PackInputsStep))
    unpack = next(s for s in post.steps if isinstance(s, GrootActionUnpackUnnormalizeStep))
    return config, pre, pack, unpack


def _assert_stats_of(step_stats: dict, dataset_stats: dict, keys=("observation.state", "action")) -> None:
    for key in keys:
        for name in ("min", "max"):
            expected = torch.tensor(dataset_stats[key][name], dtype=torch.float32).flatten()
            got = torch.as_tensor(step_stats[key][name], dtype=torch.float32).flatten()
            torch.testing.assert_close(got, expected, atol=0, rtol=0)


def _same_tree(ours: Path, theirs: Path) -> None:
    """Two folders with the same files, byte for byte."""
    names = sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    for name in names:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_the_export_carries_the_chosen_datasets_statistics_and_embodiment(mix, tmp_path: Path, caplog) -> None:
    a_act, b_act = (np.asarray(s["action"]["max"]) - np.asarray(s["action"]["min"]) for s in mix.stats)
    assert np.all(np.abs(b_act - a_act) > 0.2 * a_act)  # else the check below could not tell the datasets apart
    # train.save_lerobot_dataset=reach_b: the training's own export is the second dataset's, the choices logged
    assert "trained on 2 datasets (0: reach_a (embodiment 5), 1: reach_b (embodiment 7))" in mix.log
    assert "this one is for dataset 1 (reach_b)" in mix.log and "train.save_lerobot_dataset" in mix.log
    # (convert --dataset-index 1 of the run's checkpoint writes the same folder bit for bit: the next test)
    first = tmp_path / "default"
    with caplog.at_level(logging.WARNING, logger="loong.embodied.lerobot_io"):
        rc, log = _main("convert", str(mix.run_dir), str(first))
    assert rc == 0, log[-3000:]
    assert "this one is for dataset 0 (reach_a)" in caplog.text and "--dataset-index" in caplog.text
    for folder, index in ((mix.run_dir / "lerobot", 1), (first, 0)):
        config, _pre, pack, unpack = _lerobot_pipelines(folder)
        _assert_stats_of(pack.stats, mix.stats[index])
        _assert_stats_of(unpack.stats, mix.stats[index], keys=("action",))
        assert pack.embodiment_mapping[pack.embodiment_tag] == IDS[index]
        assert config.embodiment_tag == pack.embodiment_tag == f"loong_embodiment_{IDS[index]}"
    bad = tmp_path / "bad"
    rc, log = _main("convert", str(mix.run_dir), str(bad), "--dataset-index", "2")
    assert rc == 2 and "--dataset-index: 2 is not one of the policy's 2 dataset(s) (0: reach_a, 1: reach_b)" in log, \
        log[-3000:]
    assert not bad.exists()


def test_save_lerobot_dataset_resolves_as_dataset_index_does(tmp_path: Path, monkeypatch) -> None:
    """``train.save_lerobot_dataset`` against ``data.repo_root`` (checked before training, no dataset read): an
    index, a folder name, the folder (absolute or relative) name the same dataset; null is the export's default."""
    from loong.core.errors import LoongError
    from loong.embodied.schema import EmbodiedDataConfig
    from loong.embodied.task import lerobot_export_dataset

    for name in ("reach_a", "reach_b"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)

    def index(value, roots=(str(tmp_path / "reach_a"), "reach_b")):
        cfg = SimpleNamespace(train=SimpleNamespace(save_lerobot_dataset=value),
                              data=EmbodiedDataConfig(repo_root=list(roots)))
        return lerobot_export_dataset(cfg)

    assert index(None) is None
    assert index(0) == index("0") == index("reach_a") == index(str(tmp_path / "reach_a")) == 0
    assert index(1) == index("reach_b") == index("./reach_b") == index(str(tmp_path / "reach_b")) == 1
    for value, text in ((2, "train.save_lerobot_dataset=2: 2 is not one of data.repo_root's 2 dataset(s) "
                            "(0: reach_a, 1: reach_b)"),
                        ("reach_c", "train.save_lerobot_dataset=reach_c: 'reach_c' names none of data.repo_root's "
                                    "datasets (0: reach_a, 1: reach_b)")):
        with pytest.raises(LoongError) as err:
            index(value)
        assert str(err.value) == text


def _raw_batch(processor, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    b, chunk = 2, processor.config.chunk_size
    batch = {cam: torch.rand(b, 3, 64, 64, generator=g) for cam in processor.camera_keys}
    batch[processor.state_key] = torch.randn(b, processor.state_dim, generator=g)
    batch[processor.action_key] = torch.randn(b, chunk, processor.action_dim, generator=g) * 2
    batch["action_is_pad"] = torch.zeros(b, chunk, dtype=torch.bool)
    batch["task"] = ["reach the red target", "reach the blue target"]
    return batch


def test_a_moved_export_loads_in_lerobot_and_in_loong(mix, tmp_path: Path) -> None:
    """``convert --dataset-index 1`` of the run's checkpoint is the training's own export
    (``train.save_lerobot_dataset=reach_b``) byte for byte. No absolute path inside; moved whole, lerobot (working
    directory: the folder) gives Loong's loss on dataset 1's samples (its statistics and embodiment), and Loong's
    importer reads it from anywhere."""
    from lerobot.policies.groot.modeling_groot import GrootPolicy

    from loong.embodied.inference import load_policy
    from loong.embodied.lerobot_io import import_lerobot

    first = tmp_path / "first"
    rc, log = _main("convert", str(mix.run_dir), str(first), "--dataset-index", "1")
    assert rc == 0, log[-3000:]
    _same_tree(mix.run_dir / "lerobot", first)  # train.save_lerobot_dataset=reach_b's export, byte for byte
    for path in first.rglob("*.json"):
        text = path.read_text()
        assert str(tmp_path) not in text and str(mix.base) not in text, path
    moved = tmp_path / "elsewhere" / "policy"
    moved.parent.mkdir()
    shutil.move(str(first), str(moved))
    loaded = load_policy(mix.run_dir, device="cpu", dtype="fp32")
    name, _config, state, _stats = import_lerobot(moved)
    assert name == "groot_n1_7" and set(state) == set(loaded.policy.state_dict())
    assert all(torch.equal(v, loaded.policy.state_dict()[k]) for k, v in state.items())
    with contextlib.chdir(moved):
        theirs = GrootPolicy.from_pretrained(".").eval()
        _config, pre, _pack, _unpack = _lerobot_pipelines(Path("."))
    assert os.getcwd() != str(moved)
    batch = _raw_batch(loaded.processor, seed=5)
    with torch.no_grad():
        torch.manual_seed(3)
        their_loss, _ = theirs.forward(pre(copy.deepcopy(batch)))
        torch.manual_seed(3)
        ours, _ = loaded.policy.eval().loss(loaded.processor({**batch, "dataset_index": torch.ones(2, dtype=torch.long)}))
        torch.manual_seed(3)
        first_source, _ = loaded.policy.loss(loaded.processor(batch))
    def rel(x: torch.Tensor) -> float:
        return float((x - their_loss).abs() / their_loss.abs().clamp_min(1e-12))

    # fp32 through two implementations (clipped min-max of actions up to ~3x the range): within 1e-4, where
    # dataset 0's statistics and embodiment miss by far more
    assert rel(ours) <= 1e-4, (ours.item(), their_loss.item())
    assert rel(first_source) > 1e-2, (first_source.item(), their_loss.item())


def test_serve_routes_the_clients_embodiment_id_to_its_heads(mix) -> None:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from loong.embodied.envs import ReachEnv
    from loong.embodied.inference import PolicyRunner, load_policy
    from loong.embodied.serve import PolicyServer

    loaded = load_policy(mix.run_dir, device="cpu", dtype="fp32")
    obs, info = ReachEnv().reset(seed=4)
    request = {"images": dict(obs["pixels"]), "state": obs["agent_pos"], "prompt": info["task"]}

    def by_hand(embodiment: int) -> np.ndarray:
        """predict_action_chunk for ``embodiment``, with the noise a fresh connection of seed 11 draws first."""
        proc = loaded.processor
        raw = {f"observation.images.{cam}": torch.from_numpy(np.array(img, dtype=np.float32) / 255)
               .permute(2, 0, 1)[None] for cam, img in obs["pixels"].items()}
        raw.update({proc.state_key: torch.from_numpy(np.asarray(obs["agent_pos"], np.float32))[None],
                    "task": [info["task"]], "embodiment_id": torch.tensor([embodiment])})
        inputs = proc(raw, train=False)
        assert inputs["embodiment_id"].tolist() == [embodiment]
        noise = torch.randn(1, loaded.config.chunk_size, loaded.config.max_action_dim,
                            generator=torch.Generator().manual_seed(11))
        with torch.no_grad():
            chunk = loaded.policy.predict_action_chunk(inputs, noise=noise)
        return proc.postprocess(chunk.float())[0].numpy()

    server = PolicyServer(PolicyRunner(loaded, seed=11), host="127.0.0.1", port=0)
    server.start()
    try:
        answers = {}
        for embodiment in (*IDS, None):  # a fresh connection each: each answer draws the same first noise
            client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
            message = request if embodiment is None else {**request, "embodiment_id": np.asarray(embodiment)}
            answers[embodiment] = client.infer(message)["actions"]
    finally:
        server.stop()
    for embodiment in IDS:
        np.testing.assert_allclose(answers[embodiment], by_hand(embodiment), rtol=0, atol=1e-6)
    assert not np.allclose(answers[IDS[0]], answers[IDS[1]], atol=1e-4)  # the heads differ per embodiment
    np.testing.assert_array_equal(answers[None], answers[IDS[0]])  # no id: dataset 0's embodiment


def test_eval_and_serve_take_the_dataset_of_a_mix(mix, tmp_path: Path) -> None:
    """``--source``: the mix's dataset whose statistics and embodiment the robot uses, by name or index; a name
    the policy does not know fails before anything is written or served."""
    rc, log = _main("eval", str(mix.run_dir), "--device", "cpu", "--source", "reach_b", "--episodes", "1",
                    "--no-random", "--no-progress", "-o", str(tmp_path / "eval"))
    assert rc == 0, log[-3000:]
    (summary,) = [json.loads(p.read_text()) for p in (tmp_path / "eval").glob("*.json")]
    assert summary["source"] == 1
    for verb, extra in (("eval", ["-o", str(tmp_path / "bad")]), ("serve", ["--port", "0"])):
        rc, log = _main(verb, str(mix.run_dir), "--device", "cpu", "--source", "reach_c", *extra)
        assert rc == 2 and "--source: 'reach_c' names none of the policy's datasets (0: reach_a, 1: reach_b)" in log, log
        assert not (tmp_path / "bad").exists()
