"""The trainer's safety features on the fsdp engine (the same trainer as the megatron engine's).

A toy run killed in a step's forward or in the middle of a checkpoint write, or restarted by torchrun after a
worker failure, rerun with ``train.resume=auto``, ends with the uninterrupted run's weights and Adam moments
bit for bit (every tensor of the final DCP checkpoint compared with ``torch.equal``; with ``train.ema_decay`` the
moving averages of the weights too). In-process: NaN steps
follow ``train.on_nonfinite``, SIGTERM saves and stops, an out-of-memory names the fsdp engine's options, the
profiler and the run's files (JSONL, TensorBoard, loss PNG) are written, a checkpoint of another model is refused
with the keys that differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loong.core.checkpoint.inspect import checkpoint_tensors
from loong.core.errors import LoongError

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).parent / "workers"
WORKER = WORKERS / "fsdp_fault.py"
STEPS = 6


def _launch(fault: str, out: Path, name: str, layout: str, max_restarts: int = 0) -> tuple[int, str]:
    """Run the worker (two ranks for the dp2/hybrid layouts); returns (exit code, output)."""
    args = [str(WORKER), fault, str(out), name, layout]
    if not layout.startswith("single") or max_restarts:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={1 if layout.startswith('single') else 2}",
                f"--max-restarts={max_restarts}", *args]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    env["OMP_NUM_THREADS"] = "1"
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{name}.{fault.replace(':', '-')}.log"
    with log.open("w") as fh:  # a file, not a pipe: nothing a killed process leaves behind keeps the test waiting
        rc = subprocess.run([sys.executable, *args], stdout=fh, stderr=subprocess.STDOUT, env=env,
                            timeout=600).returncode
    return rc, log.read_text()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp_faults")


@pytest.fixture(scope="module")
def reference(root: Path):  # noqa: ANN201
    """``reference(layout)``: every tensor of the uninterrupted run's final checkpoint (run once per layout)."""
    done: dict[str, dict[str, torch.Tensor]] = {}

    def get(layout: str) -> dict[str, torch.Tensor]:
        if layout not in done:
            rc, log = _launch("none", root / "ref", layout, layout)
            assert rc == 0, log[-3000:]
            done[layout] = checkpoint_tensors(root / "ref" / layout / "checkpoints" / f"step_{STEPS:08d}")
        return done[layout]

    return get


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    assert any(".exp_avg_sq" in k for k in got)  # Adam's moments are compared too
    assert [k for k in got if not torch.equal(got[k], want[k])] == []


@pytest.mark.parametrize("layout,fault,resumed_from", [
    ("dp2", "forward:3", (2,)),
    ("hybrid", "save:4", (2,)),
    # killed in step 5 while the step-4 async save may still be writing: 4 if it finished, else 2
    ("single-async", "forward:5", (4, 2)),
    ("dp2-ema", "forward:3", (2,)),
])  # fmt: skip
def test_sigkill_then_resume_is_bitwise_identical(root: Path, reference, layout: str, fault: str,  # noqa: ANN001
                                                  resumed_from: tuple[int, ...]) -> None:
    out, name = root / "killed", f"{layout}-{fault.replace(':', '-')}"
    rc, log = _launch(fault, out, name, layout)
    assert rc != 0, log[-3000:]
    ckpts = out / name / "checkpoints"
    if fault.startswith("save"):  # killed mid-write: the half-written step is a hidden temporary only
        step = int(fault.split(":")[1])
        assert (ckpts / f".step_{step:08d}.tmp").is_dir()
        assert not (ckpts / f"step_{step:08d}").exists()
    rc, log = _launch("none", out, name, layout)
    assert rc == 0, log[-3000:]
    assert any(f"resumed from {ckpts / f'step_{s:08d}'} at step {s}" in log for s in resumed_from), log[-3000:]
    final = checkpoint_tensors(ckpts / f"step_{STEPS:08d}")
    _assert_bitwise(final, reference(layout))
    averages = sorted(k.removeprefix("ema.") for k in final if k.startswith("ema."))
    if layout.endswith("-ema"):  # an average of every weight, and not the weights themselves
        assert averages == sorted(k.removeprefix("model.") for k in final if k.startswith("model."))
        assert not torch.equal(final["ema.norm.weight"], final["model.norm.weight"])
    else:
        assert averages == []


def test_elastic_restart_after_worker_failure(root: Path, reference) -> None:  # noqa: ANN001
    out = root / "elastic"
    rc, log = _launch("raise:3", out, "dp2", "dp2", max_restarts=1)
    assert rc == 0, log[-3000:]
    assert "injected worker failure" in log and "finished at step 6" in log
    assert f"resumed from {out / 'dp2' / 'checkpoints' / 'step_00000002'} at step 2" in log, log[-3000:]
    _assert_bitwise(checkpoint_tensors(out / "dp2" / "checkpoints" / f"step_{STEPS:08d}"), reference("dp2"))


@pytest.fixture
def faulty_run():  # noqa: ANN201
    sys.path.insert(0, str(WORKERS))
    from fsdp_fault import faulty_run

    return faulty_run


def test_nonfinite_policies(tmp_path: Path, faulty_run) -> None:  # noqa: ANN001
    with pytest.raises(LoongError, match=r"step 3.*train.on_nonfinite=stop"):
        faulty_run("nan:3", str(tmp_path), "stop", "single")
    skipped = faulty_run("nan:3", str(tmp_path), "skip", "single", on_nonfinite="skip")
    assert skipped.last_step == STEPS and skipped.last_loss == skipped.last_loss  # finite at the end
    rolled = faulty_run("nan:3", str(tmp_path), "rollback", "single", on_nonfinite="rollback")
    assert rolled.last_step == STEPS
    log = (tmp_path / "rollback" / "metrics.jsonl").read_text()
    assert '"rollback_to": 2' in log and '"skipped_batch": 2' in log


def test_nonfinite_gradient_names_its_parameters(tmp_path: Path, faulty_run) -> None:  # noqa: ANN001
    with pytest.raises(LoongError, match=r"step 3.*norm\.weight"):
        faulty_run("nangrad:3", str(tmp_path), "nangrad", "single")


def test_sigterm_saves_and_stops(tmp_path: Path, faulty_run) -> None:  # noqa: ANN001
    result = faulty_run("term:3", str(tmp_path), "term", "single")
    assert result.interrupted and result.last_step == 3
    assert result.checkpoint == tmp_path / "term" / "checkpoints" / "step_00000003"
    resumed = faulty_run("none", str(tmp_path), "term", "single")
    assert resumed.last_step == STEPS and not resumed.interrupted


def test_out_of_memory_names_the_fsdp_options(tmp_path: Path, faulty_run) -> None:  # noqa: ANN001
    with pytest.raises(LoongError) as err:
        faulty_run("oom:3", str(tmp_path), "oom", "single")
    text = str(err.value)
    assert "step 3 ran out of" in text and "step_00000002" in text and "is intact" in text
    assert "model.recompute=selective" in text and "parallel.fsdp_cpu_offload=true" in text
    assert "distributed_optimizer" not in text  # a megatron option, meaningless here


def test_run_files_and_profiler(tmp_path: Path, faulty_run) -> None:  # noqa: ANN001
    result = faulty_run("none", str(tmp_path), "files", "single", profile_steps=[2, 3])
    run_dir = tmp_path / "files"
    assert result.loss_png is not None and result.loss_png.is_file()
    assert (run_dir / "metrics.jsonl").is_file() and any(run_dir.rglob("events.out.tfevents*"))
    assert any(run_dir.rglob("*profile*")), sorted(p.name for p in run_dir.rglob("*"))[:30]


def test_checkpoint_of_another_model_is_refused_with_the_differing_keys(tmp_path: Path) -> None:
    sys.path.insert(0, str(WORKERS))
    from toy_tasks import toy_config

    from loong.core.run import run

    llama = run(toy_config(task="toy.llama", output_dir=str(tmp_path), run_name="llama",
                           train={"steps": 1, "resume": "none"}), echo=lambda _m: None)
    # the same model config, another task's module: the trainer's config check passes, DCP's key check must not
    with pytest.raises(LoongError, match=r"another model's weights: missing \[.*blocks\..*not in this model \[.*embed"):
        run(toy_config(task="toy.dit", output_dir=str(tmp_path), run_name="dit",
                       train={"steps": 2, "resume": str(llama.checkpoint)}), echo=lambda _m: None)
