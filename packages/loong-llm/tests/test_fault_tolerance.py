"""Fault tolerance: a run killed at any moment resumes and ends bit for bit where the uninterrupted
run ends; broken checkpoints are detected and skipped; NaN/Inf steps follow ``train.on_nonfinite``.

The harness (``workers/fault_run.py``) runs the real training walk in a subprocess (one process, or
two under torchrun) with one injected fault, then the same command again with ``train.resume=auto``;
the final checkpoints (model *and* optimiser state) are compared tensor by tensor with
``torch.equal``. Every layout trains with gradient accumulation (4 micro-batches per step).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loong.core.checkpoint import read_state, verify_checkpoint
from loong.core.checkpoint.inspect import checkpoint_tensors
from loong.core.errors import LoongError

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).parent / "workers"
WORKER = WORKERS / "fault_run.py"
STEPS = 6
COMMON = ["model.num_layers=2", f"train.steps={STEPS}", "train.seq_length=32", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.save_interval=2", "train.eval_iters=0", "train.progress=false"]
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["parallel.tp=2"]), "pp2": (2, ["parallel.pp=2"]),
           "tp1-async": (1, ["train.async_save=true"]), "tp1-fused": (1, ["train.optimizer_impl=fused"])}


def _launch(fault: str, out: Path, name: str, layout: str, *extra: str, max_restarts: int = 0) -> tuple[int, str]:
    """Run the worker; returns (exit code, its output). Output goes to a file, not a pipe, so nothing
    a killed process leaves behind can keep the test waiting."""
    nproc, overrides = LAYOUTS[layout]
    args = [str(WORKER), fault, *COMMON, *overrides, f"output_dir={out}", f"run_name={name}", *extra]
    if nproc > 1 or max_restarts:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                f"--max-restarts={max_restarts}", *args]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    log = out / f"{name}.{fault}.log"
    out.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        rc = subprocess.run([sys.executable, *args], stdout=fh, stderr=subprocess.STDOUT, env=env,
                            timeout=600).returncode
    return rc, log.read_text()


def assert_bitwise_equal(got: Path, want: Path) -> None:
    a, b = checkpoint_tensors(got), checkpoint_tensors(want)
    assert sorted(a) == sorted(b)
    assert any(k.startswith("optimizer") for k in a)  # Adam moments are compared too
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(root: Path):  # noqa: ANN201
    """``reference(layout)``: the uninterrupted run's final checkpoint (run once per layout)."""
    done: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in done:
            rc, log = _launch("none", root / "ref", layout, layout)
            assert rc == 0, log[-3000:]
            done[layout] = root / "ref" / layout / "checkpoints" / f"step_{STEPS:08d}"
        return done[layout]

    return get


# --- kill anywhere, resume, continue bit for bit --------------------------------------------------
@pytest.mark.parametrize("layout,fault,resumed_from", [
    # (a kill between steps runs with the fused AdamW: its per-parameter device steps are the harder state to resume;
    # a kill in the forward and one in a save run on two ranks, and the one-rank forward kill is the async case's)
    ("tp2", "forward:3", 2), ("pp2", "save:4", 2), ("tp1-fused", "between:3", 2),
    # killed in step 5, while the step-4 async save may still be writing: 4 if it finished, else 2
    ("tp1-async", "forward:5", (4, 2)),
])  # fmt: skip
def test_sigkill_then_resume_is_bitwise_identical(root: Path, reference, layout: str, fault: str,  # noqa: ANN001
                                                  resumed_from: int | tuple[int, ...]) -> None:
    out, name = root / "killed", f"{layout}-{fault.replace(':', '-')}"
    rc, log = _launch(fault, out, name, layout)
    assert rc != 0, log[-3000:]
    ckpts = out / name / "checkpoints"
    if fault.startswith("save"):  # killed mid-write: the half-written step is a hidden temporary only
        assert (ckpts / f".step_{int(fault[5:]):08d}.tmp").is_dir()
        assert not (ckpts / f"step_{int(fault[5:]):08d}").exists()
    rc, log = _launch("none", out, name, layout)
    assert rc == 0, log[-3000:]
    allowed = resumed_from if isinstance(resumed_from, tuple) else (resumed_from,)
    assert any(f"resumed from {ckpts / f'step_{s:08d}'} at step {s}" in log for s in allowed), log[-3000:]
    assert_bitwise_equal(ckpts / f"step_{STEPS:08d}", reference(layout))


def test_elastic_restart_after_worker_failure(root: Path, reference) -> None:  # noqa: ANN001
    """torchrun --max-restarts 1: a worker raises in step 3; the group restarts and resumes by itself."""
    out = root / "elastic"
    rc, log = _launch("raise:3", out, "tp2", "tp2", max_restarts=1)
    assert rc == 0, log[-3000:]
    assert "injected worker failure" in log and "resumed from" in log
    assert_bitwise_equal(out / "tp2" / "checkpoints" / f"step_{STEPS:08d}", reference("tp2"))


# --- integrity: broken checkpoints are detected, reported and skipped ---------------------------
def _copy_run(reference, root: Path, name: str) -> Path:  # noqa: ANN001
    run = root / "broken" / name
    shutil.copytree(reference("tp1").parent.parent, run)
    return run


def _train_in_process(run: Path, *extra: str) -> tuple[int, str]:
    from loong.llm.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        rc = main(["train", *COMMON, f"output_dir={run.parent}", f"run_name={run.name}", *extra])
    return rc, err.getvalue()


def _shard(step_dir: Path) -> Path:
    return next(step_dir.glob("*.distcp"))


@pytest.mark.parametrize("damage,reason", [
    ("truncate", "truncated"), ("flip", "corrupted (SHA-256 differs"), ("manifest", "incomplete: no manifest.json"),
])  # fmt: skip
def test_resume_auto_skips_a_broken_newest_checkpoint(root: Path, reference, damage: str, reason: str) -> None:  # noqa: ANN001
    run = _copy_run(reference, root, damage)
    newest = run / "checkpoints" / f"step_{STEPS:08d}"
    shard = _shard(newest)
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit, same size: only the checksum sees it
        shard.write_bytes(bytes(data))
    else:
        (newest / "manifest.json").unlink()
    with pytest.raises(LoongError, match=reason.split(" (")[0].replace("(", r"\(")):
        verify_checkpoint(newest)
    # Named explicitly, the broken checkpoint is refused (never loaded) with the reason.
    rc, log = _train_in_process(run.with_name(f"{damage}-explicit"), f"train.steps={STEPS + 4}",
                                f"train.resume={newest}")
    assert rc != 0 and reason in log and "cannot be loaded" in log
    # resume=auto says why it skips the newest and continues from the one before.
    rc, log = _train_in_process(run, f"train.steps={STEPS + 2}")
    assert rc == 0, log[-3000:]
    assert f"skipping checkpoint step_{STEPS:08d}: " in log and reason in log
    assert f"resumed from {run / 'checkpoints' / f'step_{STEPS - 2:08d}'}" in log


def test_checkpoint_of_another_model_is_a_clear_error(root: Path, reference) -> None:  # noqa: ANN001
    run = _copy_run(reference, root, "other-model")
    rc, log = _train_in_process(run, f"train.steps={STEPS + 2}", "model.num_layers=3")
    assert rc != 0
    assert "was saved for another model (model.num_layers=2 in the checkpoint, 3 now)" in log


def test_convert_refuses_a_corrupted_checkpoint(root: Path, reference, tmp_path: Path) -> None:  # noqa: ANN001
    from loong.llm.cli import main

    run = _copy_run(reference, root, "convert")
    step = run / "checkpoints" / f"step_{STEPS:08d}"
    shard = _shard(step)
    shard.write_bytes(shard.read_bytes()[:-10])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["convert", str(step), str(tmp_path / "hf")])
    assert rc != 0 and "cannot be loaded" in err.getvalue() and "truncated" in err.getvalue()


def test_checkpoint_records_everything_a_continuation_needs(reference) -> None:  # noqa: ANN001
    step_dir = reference("tp1")
    state = read_state(step_dir)
    assert state["step"] == STEPS and state["consumed_samples"] == STEPS * 8
    assert state["data"] == {"next_batch": STEPS, "skipped_batches": []}
    assert state["loss_scale"] == 1.0 and state["scheduler"]["num_steps"] == STEPS
    rng = torch.load(step_dir / "rng" / "rank_00000.pt", weights_only=True)  # nothing unpickled
    assert set(rng["state"]) >= {"python", "numpy", "torch_cpu", "megatron_tracker"}
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert {"trainer_state.json", "config.yaml", "rng/rank_00000.pt"} <= set(manifest["files"])
    assert all(len(m["sha256"]) == 64 for m in manifest["files"].values())


# --- NaN / Inf policy ---------------------------------------------------------------------------
def _nan_run(tmp_path: Path, policy: str, fault: str = "nan:3", *extra: str) -> tuple[int, str, Path]:
    sys.path.insert(0, str(WORKERS))
    import fault_run  # registers the test-only task "test.faulty"

    fault_run.FAULT = fault
    try:
        run = tmp_path / policy
        rc, log = _train_in_process(run, "task=test.faulty", f"train.on_nonfinite={policy}", *extra)
    finally:
        fault_run.FAULT = "none"
    return rc, log, run


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_nonfinite_stop(tmp_path: Path) -> None:
    rc, log, run = _nan_run(tmp_path, "stop")
    assert rc != 0
    assert "step 3 (global batch 2): the loss term 'loss' is NaN/Inf" in log and "stopped" in log
    verify_checkpoint(run / "checkpoints" / "step_00000002")  # the last good checkpoint is intact
    assert not (run / "checkpoints" / "step_00000004").exists()


def test_nonfinite_gradient_names_its_parameters(tmp_path: Path) -> None:
    """A finite loss with a NaN gradient: the stop message says which parameters' gradients were not finite."""
    rc, log, _ = _nan_run(tmp_path, "stop", "nangrad:2")
    assert rc != 0
    assert ("step 2 (global batch 1): the loss term 'loss' is finite" in log
            and "gradients are non-finite in 1 parameter (decoder.final_layernorm.weight)" in log), log[-2000:]


def test_nonfinite_probe_names_where_the_backward_made_it(tmp_path: Path) -> None:
    """The parameters only say how far the NaN spread; train.nonfinite_probe=true names the first non-finite
    activation gradient of the backward: here at the final norm's output, where the injected fault sits."""
    rc, log, _ = _nan_run(tmp_path, "stop", "nanact:2", "train.nonfinite_probe=true")
    assert rc != 0
    assert "first non-finite: the gradient of output 0 of decoder.final_layernorm" in log, log[-2000:]
    assert "the last finite output gradient before it: none" not in log, log[-2000:]
    rc, log, _ = _nan_run(tmp_path / "off", "stop", "nanact:2")
    assert rc != 0 and "train.nonfinite_probe=true names where the backward first produced it" in log, log[-2000:]


def test_out_of_memory_names_what_would_fit(tmp_path: Path) -> None:
    """torch's OutOfMemoryError in step 3 becomes a clear error: the step, torch's first line, the intact step-2
    checkpoint, and the memory options this run does not use yet (the model's own first)."""
    rc, log, run = _nan_run(tmp_path, "stop", "oom:3")
    assert rc != 0
    ckpt = run / "checkpoints" / "step_00000002"
    assert (f"step 3 ran out of cpu memory (CUDA out of memory. Tried to allocate 7.00 GiB (injected)); the last "
            f"checkpoint, {ckpt}, is intact. Options that lower memory, cheapest first:") in log, log[-2000:]
    options = log[log.index("cheapest first:"):]
    assert options.index("model.recompute=full") < options.index("train.micro_batch_size=1")
    assert "parallel.tp" in options
    assert "grad_reduce_in_bf16" not in options  # an fp32 run: no bf16 gradient buffer to offer
    assert "optimizer_cpu_offload" not in options  # the CPU cannot offload
    verify_checkpoint(ckpt)
    assert not (run / "checkpoints" / "step_00000004").exists()


def test_nonfinite_skip(tmp_path: Path) -> None:
    rc, log, run = _nan_run(tmp_path, "skip")
    assert rc == 0, log[-3000:]
    assert "skipped step 3 (global batch 2)" in log
    assert [r["nonfinite_skipped"] for r in _records(run) if "nonfinite_skipped" in r] == [1]
    final = run / "checkpoints" / f"step_{STEPS:08d}"
    assert read_state(final)["nonfinite_steps"] == 1
    assert all(torch.isfinite(t).all() for t in checkpoint_tensors(final).values() if t.is_floating_point())


def test_nonfinite_rollback_skips_the_batch(tmp_path: Path) -> None:
    rc, log, run = _nan_run(tmp_path, "rollback")
    assert rc == 0, log[-3000:]
    assert "rolled back to step_00000002 and skipping global batch 2" in log
    events = [r for r in _records(run) if "rollback_to" in r]
    assert events == [{**events[0], "step": 3, "rollback_to": 2, "skipped_batch": 2}]
    state = read_state(run / "checkpoints" / f"step_{STEPS:08d}")
    assert state["data"] == {"next_batch": STEPS + 1, "skipped_batches": [2]}
    assert state["nonfinite_steps"] == 1
