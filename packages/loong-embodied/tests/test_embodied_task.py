"""The ``embodied.vla`` task on the test-only toy policy (``toy_policy.py``, a fraction of a second per step): the
``model.config`` section parsed by the policy's own dataclass (bad keys and values exit 2 naming the dotted key,
nothing written), ``<run>/policy/`` written and loadable, the stream a function of (seed, step): a resumed run
continues bit-exactly, DataLoader workers and recomputation change nothing, DP=2 over gloo equals one rank, and
``model.init_from`` starts from a checkpoint's weights."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loong.embodied.cli import main
from loong.embodied.task import POLICY_DIR, POLICY_JSON

sys.path.insert(0, str(Path(__file__).parent))  # the helpers beside the tests (pytest's importlib mode adds none)
import toy_policy  # noqa: E402  (registers the "toy" policy)

#: a small synthetic dataset (written once per test module into <output_dir>/.cache)
DATA = ["data.synthetic_episodes=12", "train.progress=false", "train.eval_interval=0", "train.eval_iters=0",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.lr_decay_style=constant",
        "train.warmup_steps=2"]


def _main(*argv: str) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, out.getvalue() + err.getvalue()


def _train(out: Path, *argv: str) -> tuple[int, str]:
    return _main("train", "model.policy=toy", f"output_dir={out}", *DATA, *argv)


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train_loss"] for r in map(json.loads, lines) if "train_loss" in r}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("embodied_task")


@pytest.mark.parametrize(("argv", "expected"), [
    (["model.config.chunk_sise=4"], ["unknown config key 'model.config.chunk_sise'", "did you mean 'chunk_size'",
                                     "model.policy=toy (ToyConfig) has: chunk_size, n_action_steps"]),
    (["model.config.width=wide"], ["model.config.width: expected an integer"]),
    (["model.chunk_size=4"], ["unknown config key 'model.chunk_size'", "model.config.chunk_size"]),
    (["model.preset=huge"], ["model.preset=huge: not a preset of model.policy=toy", "its presets: tiny"]),
    (["model.policy=pi5"], ["model.policy=pi5: not a policy", "did you mean 'pi05'"]),
    (["data.num_workers=-1"], ["data.num_workers=-1: must be >= 0"]),
    (["data.weights=[1,2]"], ["data.weights=[1.0, 2.0]: one weight per dataset"]),
    (["data.repo_root=/nonexistent/ds"], ["data.repo_root=/nonexistent/ds: no such folder"]),
    (["policy=pi6"], ["unknown policy preset 'pi6'"]),
    (["train.cuda_graphs=true", "parallel.fsdp=none"],
     ["train.cuda_graphs=true: model.policy=toy: its training step is not declared capture-safe"]),
    (["train.cuda_graphs=true"], ["train.cuda_graphs=true with parallel.fsdp=full: FSDP2 gathers"]),
])
def test_bad_config_exits_2_naming_the_key_and_writes_nothing(tmp_path: Path, argv: list[str],
                                                              expected: list[str]) -> None:
    rc, log = _train(tmp_path / "out", *argv)
    assert rc == 2, log
    for text in expected:
        assert text in log, log
    assert not (tmp_path / "out").exists()


def test_policy_folder_and_a_resumed_run_continues_bit_exactly(out: Path) -> None:
    for argv in (["run_name=whole", "train.steps=6"], ["run_name=cut", "train.steps=3"],
                 ["run_name=cut", "train.steps=6"]):
        rc, log = _train(out, *argv, "model.config.width=16")
        assert rc == 0, log
    assert "resumed from" in log and "at step 3" in log
    whole, cut = _losses(out / "whole"), _losses(out / "cut")
    assert sorted(cut) == list(range(1, 7))
    assert [cut[s] for s in range(1, 7)] == [whole[s] for s in range(1, 7)]  # bit-exact
    record = json.loads((out / "whole" / POLICY_DIR / POLICY_JSON).read_text())
    assert record["policy"] == "toy"
    assert record["config"]["width"] == 16 and record["config"]["chunk_size"] == 4
    processor = toy_policy.ToyProcessor.load(out / "whole" / POLICY_DIR, toy_policy.ToyConfig(**record["config"]))
    assert processor.meta["cameras"] == ["observation.images.top", "observation.images.wrist"]
    assert (out / "whole" / "checkpoints" / "step_00000006" / POLICY_DIR / POLICY_JSON).is_file()
    rc, log = _train(out, "run_name=whole", "train.steps=6", "model.config.width=16")
    assert rc == 0 and "is finished" in log, log


def test_workers_recompute_and_dp2_give_the_losses_of_one_process(out: Path) -> None:
    rc, log = _train(out, "run_name=one", "train.steps=3")
    assert rc == 0, log
    rc, log = _train(out, "run_name=workers", "train.steps=3", "data.num_workers=2")
    assert rc == 0, log
    one = _losses(out / "one")
    assert _losses(out / "workers") == one
    for mode in ("full", "selective"):  # recomputation changes no number
        rc, log = _train(out, f"run_name=recompute_{mode}", "train.steps=3", f"model.recompute={mode}")
        assert rc == 0, log
        assert _losses(out / f"recompute_{mode}") == pytest.approx(one, rel=1e-6)
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOONG_SINGLE_PROCESS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    worker = Path(__file__).parent / "workers" / "toy_train.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(worker), f"output_dir={out}", *DATA, "run_name=dp2", "train.steps=3"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2" in proc.stderr, proc.stderr[-3000:]
    dp2 = _losses(out / "dp2")
    assert sorted(dp2) == sorted(one)
    assert [dp2[s] for s in sorted(one)] == pytest.approx([one[s] for s in sorted(one)], rel=1e-5, abs=1e-7)


def test_init_from_a_loong_checkpoint_starts_from_its_weights(out: Path) -> None:
    from loong.core.checkpoint.inspect import checkpoint_tensors

    source = out / "whole"  # the run of test_policy_folder_and_a_resumed_run_continues_bit_exactly (6 steps)
    if not (source / "checkpoints").is_dir():
        rc, log = _train(out, "run_name=whole", "train.steps=6", "model.config.width=16")
        assert rc == 0, log
    rc, log = _train(out, "run_name=init", "train.steps=1", "train.lr=0", "train.min_lr=0", "model.config.width=16",
                     f"model.init_from={source}")
    assert rc == 0, log
    start = checkpoint_tensors(out / "init" / "checkpoints" / "step_00000001")
    trained = checkpoint_tensors(source / "checkpoints" / "step_00000006")
    weights = [k for k in trained if k.startswith("model.")]
    assert weights and all(start[k].equal(trained[k]) for k in weights)
    rc, log = _train(out, "run_name=bad_init", "train.steps=1", f"model.init_from={source}")  # width 32, not 16
    assert rc == 2 and "model.init_from=" in log and "does not fit" in log, log
