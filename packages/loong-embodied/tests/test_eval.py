"""Loading a trained policy and closed-loop eval: which step and which weights a CKPT path gives, the runner's
observation formats and seeded noise, the rollout loop driven by the scripted expert, ``evaluate``'s numbers
and files for a policy and the random baseline, and the CLI's bad paths (exit 2, one line)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
import inference_testing as toy  # noqa: E402

from loong.core.checkpoint import CheckpointManager  # noqa: E402
from loong.core.errors import LoongError  # noqa: E402
from loong.embodied.cli import main  # noqa: E402
from loong.embodied.envs import ExpertPolicy, RandomPolicy  # noqa: E402
from loong.embodied.eval import DEFAULT_ENV, evaluate, make_env, run_episodes  # noqa: E402
from loong.embodied.inference import PolicyRunner, env_observation, load_policy  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("toy") / "run"
    toy.write_run(run, steps=(3, 5))
    return run


def test_ckpt_paths_pick_the_step_and_the_weights(run_dir: Path) -> None:
    for path in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "step_00000005"):
        loaded = load_policy(path, device="cpu")
        assert loaded.step == 5 and loaded.step_dir.name == "step_00000005" and loaded.run_dir == run_dir
        assert loaded.policy.gain.item() == 1.0 and not loaded.policy.training
        assert not any(p.requires_grad for p in loaded.policy.parameters())
    assert load_policy(run_dir / "checkpoints" / "step_00000003").policy.gain.item() == 0.0
    ema = load_policy(run_dir, ema=True)
    assert ema.policy.gain.item() == -1.0 and ema.ema
    # tensors outside the average (buffers) are the weights' own
    assert torch.equal(ema.policy.action_stats, torch.tensor([toy.STATS["action_mean"], toy.STATS["action_std"]]))
    assert isinstance(ema.processor, toy.ToyProcessor) and ema.config == toy.ToyConfig()


def test_bad_ckpt_paths(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(LoongError, match="no such file or folder"):
        load_policy(tmp_path / "missing")
    with pytest.raises(LoongError, match="not a Loong checkpoint"):
        load_policy(tmp_path)
    with pytest.raises(LoongError, match=f"is an output folder, not a run; name one of its runs: {run_dir}"):
        load_policy(run_dir.parent)
    no_ema = tmp_path / "no_ema"
    toy.write_run(no_ema, ema_gain=None)
    with pytest.raises(LoongError, match="no moving averages"):
        load_policy(no_ema, ema=True)
    shutil.rmtree(no_ema / "policy")
    with pytest.raises(LoongError, match=r"policy\.json: not found"):
        load_policy(no_ema)
    bad_name = tmp_path / "bad_name"
    toy.write_run(bad_name)
    (bad_name / "policy" / "policy.json").write_text(json.dumps({"policy": "pi5", "config": {}}))
    with pytest.raises(LoongError, match="unknown policy 'pi5'.*pi05"):
        load_policy(bad_name)
    (bad_name / "policy" / "policy.json").write_text(json.dumps({"policy": toy.NAME, "config": {"chunk": 4}}))
    with pytest.raises(LoongError, match="unknown config key 'policy.json:config.chunk'.*chunk_size"):
        load_policy(bad_name)
    other = tmp_path / "other_model"
    toy.write_run(other)
    CheckpointManager(other / "checkpoints").save(9, toy._Weights({"model": {"gain": torch.ones(()),
                                                                          "head.weight": torch.ones(2, 2)}}),
                                                  {"step": 9}, {})
    with pytest.raises(LoongError, match="another model's weights: missing .*'action_stats'.*not in this model "
                                         r"\['head.weight'\]"):
        load_policy(other)
    if not torch.cuda.is_available():
        with pytest.raises(LoongError, match="--device cuda: no CUDA device here"):
            load_policy(run_dir, device="cuda")


def test_runner_formats_and_seeded_noise(run_dir: Path) -> None:
    loaded = load_policy(run_dir)
    env = make_env(DEFAULT_ENV)
    obs, info = env.reset(seed=3)
    robot = env_observation(obs, info["task"])
    assert set(robot) == {"observation.images.top", "observation.images.wrist", "observation.state", "task"}
    a = PolicyRunner(loaded, seed=7).infer(robot)["actions"]
    assert a.shape == (4, 2) and a.dtype == np.float32
    # channel-first uint8 and float [0, 1] images are the same observation
    chw = {**robot, **{k: np.ascontiguousarray(v.transpose(2, 0, 1)) for k, v in robot.items() if "images" in k}}
    flt = {**robot, **{k: v.astype(np.float32) / 255 for k, v in robot.items() if "images" in k}}
    np.testing.assert_array_equal(PolicyRunner(loaded, seed=7).infer(chw)["actions"], a)
    np.testing.assert_allclose(PolicyRunner(loaded, seed=7).infer(flt)["actions"], a, rtol=1e-6)
    assert not np.allclose(PolicyRunner(loaded, seed=8).infer(robot)["actions"], a)  # the seed is the noise's
    # the chunk points at the target in robot units: the toy's step, unnormalised by postprocess
    scene = env.unwrapped
    expected = np.clip((scene.target_position - scene.agent_position) / 0.1, -1, 1)
    np.testing.assert_allclose(a, np.broadcast_to(expected, a.shape), atol=0.1)
    # act: n_action_steps (2) actions of a chunk, then a new prediction
    runner = PolicyRunner(loaded, seed=7)
    calls = loaded.policy.calls
    first = [runner.act(robot) for _ in range(3)]
    assert loaded.policy.calls == calls + 2
    np.testing.assert_array_equal(first[0], a[0])
    np.testing.assert_array_equal(first[1], a[1])
    with pytest.raises(LoongError, match="no observation.images.top"):
        runner.infer({k: v for k, v in robot.items() if k != "observation.images.top"})
    with pytest.raises(LoongError, match="no task"):
        runner.infer({k: v for k, v in robot.items() if k != "task"})
    assert PolicyRunner(loaded, default_task=info["task"]).infer({k: v for k, v in robot.items() if k != "task"})
    with pytest.raises(LoongError, match=r"\[h, w, 3\] or \[3, h, w\]"):
        runner.infer({**robot, "observation.images.top": np.zeros((64, 64), np.uint8)})
    with pytest.raises(LoongError, match="n_action_steps: must be 1..chunk_size"):
        PolicyRunner(loaded, n_action_steps=5)
    # bf16: the weights cast, the policy run under autocast, the actions float32 robot units again
    half = load_policy(run_dir, dtype="bf16", device="cpu")
    assert half.policy.action_stats.dtype == torch.bfloat16
    bf16 = PolicyRunner(half, seed=7).infer(robot)["actions"]
    assert bf16.dtype == np.float32
    np.testing.assert_allclose(bf16, a, atol=0.05)


def test_rollout_loop_with_the_scripted_expert() -> None:
    env = make_env(DEFAULT_ENV)
    seeds = list(range(20))
    expert = run_episodes(env, ExpertPolicy(), seeds, record=1)
    assert sum(r.success for r in expert) >= 19
    assert all(r.ret == float(r.success) for r in expert)  # reach: reward 1 at the success step only
    assert len(expert[0].frames) == expert[0].length + 1 and not expert[1].frames
    random = run_episodes(env, RandomPolicy(), seeds)
    assert sum(r.success for r in random) <= 4
    assert all(r.length == 50 for r in random if not r.success)  # the env's cap


def test_evaluate_policy_and_random(run_dir: Path, tmp_path: Path) -> None:
    s = evaluate(run_dir, episodes=8, seed=100, record=2, progress=False)
    assert s["policy"]["success_rate"] >= 0.85 and s["random"]["success_rate"] <= 0.25
    assert s["margin"] == pytest.approx(s["policy"]["success_rate"] - s["random"]["success_rate"])
    for block in (s["policy"], s["random"]):
        eps = block["per_episode"]
        assert [e["seed"] for e in eps] == list(range(100, 108))
        assert block["successes"] == sum(e["success"] for e in eps)
        assert block["mean_return"] == pytest.approx(np.mean([e["ret"] for e in eps]))
    out = run_dir / "eval"
    assert s["files"] == [str(out / f"step_00000005.{ext}") for ext in ("json", "gif", "png")]
    assert json.loads((out / "step_00000005.json").read_text()) == s
    gif = Image.open(out / "step_00000005.gif")
    longest = max(e["length"] for e in s["policy"]["per_episode"][:2]) + 1
    assert gif.n_frames == longest and gif.size[0] == 2 * gif.size[1]  # two rollouts side by side
    assert Image.open(out / "step_00000005.png").size == (8 * gif.size[1], 2 * gif.size[1])
    # the EMA weights (gain -1) walk away from the target: the numbers come from the loaded weights
    e = evaluate(run_dir, episodes=4, ema=True, random_baseline=False, record=0, output=tmp_path, progress=False)
    assert e["policy"]["success_rate"] == 0 and "random" not in e and "margin" not in e
    assert e["files"] == [str(tmp_path / "step_00000005_ema.json")]


def test_cli_eval(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(run_dir), "--episodes", "3", "--no-progress", "--record", "1", "-o", str(tmp_path),
                 "--json", "--env-kwarg", "max_steps=30"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["env_kwargs"] == {"max_steps": 30} and summary["policy"]["episodes"] == 3
    assert "policy: success" in captured.err and "random: success" in captured.err and "margin:" in captured.err
    assert all(e["length"] <= 30 for e in summary["random"]["per_episode"])


@pytest.mark.parametrize("args, message", [
    (["eval", "{tmp}/missing"], "{tmp}/missing: no such file or folder"),
    (["eval", "{tmp}"], "{tmp} is not a Loong checkpoint"),
    (["eval", "{run}", "--episodes", "0"], "--episodes: must be an int >= 1"),
    (["eval", "{run}", "--env", "loong/Nope-v0"], "--env loong/Nope-v0:"),
    (["eval", "{run}", "--env-kwarg", "size"], "--env-kwarg 'size': must be KEY=VALUE"),
    (["eval", "{run}", "--env-kwarg", "size=3", "--no-progress"], "--env-kwarg: loong/Reach-v0 does not take"),
    (["serve", "{tmp}/missing", "--port", "0"], "{tmp}/missing: no such file or folder"),
    (["serve", "{run}", "--map", "prompt"], "--map 'prompt': must be CLIENT_KEY=POLICY_KEY"),
])
def test_cli_bad_input_exits_2(args: list[str], message: str, run_dir: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    fill = {"tmp": str(tmp_path), "run": str(run_dir)}
    assert main([a.format(**fill) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: " + message.format(**fill)), err


def test_trained_pi05_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real thing, kept small: `loong-embodied train` (the default tiny Pi0.5 on the reach task, 2 steps),
    then `loong-embodied eval` on its run and the policy served to openpi's client."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from loong.embodied.serve import PolicyServer

    train = [sys.executable, "-m", "loong.embodied.cli", "train", f"output_dir={tmp_path}", "run_name=pi",
             "data.synthetic_episodes=8", "train.progress=false", "train.eval_interval=0", "train.eval_iters=0",
             "train.global_batch_size=2", "train.micro_batch_size=2", "train.steps=2", "train.warmup_steps=1"]
    proc = subprocess.run(train, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "pi"
    assert main(["eval", str(run), "--episodes", "2", "--max-steps", "6", "--record", "1", "--no-progress",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["policy_name"] == "pi05" and summary["step"] == 2
    assert [e["length"] for e in summary["policy"]["per_episode"]] == [6, 6]  # nothing learnt in 2 steps
    assert all(Path(f).is_file() for f in summary["files"]) and len(summary["files"]) == 3

    loaded = load_policy(run)
    server = PolicyServer(PolicyRunner(loaded, seed=1), host="127.0.0.1", port=0)
    server.start()
    try:
        client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
        meta = client.get_server_metadata()
        assert meta["cameras"] == ["observation.images.top", "observation.images.wrist"] and meta["action_dim"] == 2
        env = make_env(DEFAULT_ENV)
        local = PolicyRunner(loaded, seed=1)
        for s in range(2):
            obs, info = env.reset(seed=s)
            sent = {"images": obs["pixels"], "state": obs["agent_pos"], "prompt": info["task"]}
            actions = client.infer(sent)["actions"]
            assert actions.shape == (loaded.config.chunk_size, 2) and np.isfinite(actions).all()
            np.testing.assert_array_equal(actions, local.infer(env_observation(obs, info["task"]))["actions"])
    finally:
        server.stop()
