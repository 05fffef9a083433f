"""Kill-and-resume on the fsdp engine: a toy run killed in a step's forward or in the middle of a checkpoint
write, rerun with ``train.resume=auto``, ends with the uninterrupted run's weights and Adam moments bit for bit
(every tensor of the final DCP checkpoint compared with ``torch.equal``). Also: a checkpoint of another model
is refused with the keys that differ."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from loong.core.errors import LoongError

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).parent / "workers"
WORKER = WORKERS / "fsdp_fault.py"
STEPS = 6


def _launch(fault: str, out: Path, name: str, layout: str) -> tuple[int, str]:
    """Run the worker (two ranks for the dp2/hybrid layouts); returns (exit code, output)."""
    args = [str(WORKER), fault, str(out), name, layout]
    if not layout.startswith("single"):
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    env["OMP_NUM_THREADS"] = "1"
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{name}.{fault.replace(':', '-')}.log"
    with log.open("w") as fh:  # a file, not a pipe: nothing a killed process leaves behind keeps the test waiting
        rc = subprocess.run([sys.executable, *args], stdout=fh, stderr=subprocess.STDOUT, env=env,
                            timeout=600).returncode
    return rc, log.read_text()


def final_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimiser), read without building a model."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(step_dir), f"{tmp}/all.pt")
        state = torch.load(f"{tmp}/all.pt", weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: object) -> None:
        if torch.is_tensor(node):
            flat[prefix] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", state)
    return flat


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp_faults")


@pytest.mark.parametrize("layout,fault,resumed_from", [
    ("dp2", "forward:3", (2,)),
    ("hybrid", "save:4", (2,)),
    # killed in step 5 while the step-4 async save may still be writing: 4 if it finished, else 2
    ("single-async", "forward:5", (4, 2)),
])  # fmt: skip
def test_sigkill_then_resume_is_bitwise_identical(root: Path, layout: str, fault: str,
                                                  resumed_from: tuple[int, ...]) -> None:
    rc, log = _launch("none", root / "ref", layout, layout)
    assert rc == 0, log[-3000:]
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
    got = final_tensors(ckpts / f"step_{STEPS:08d}")
    want = final_tensors(root / "ref" / layout / "checkpoints" / f"step_{STEPS:08d}")
    assert sorted(got) == sorted(want)
    assert any(".exp_avg_sq" in k for k in got)  # Adam's moments are compared too
    assert [k for k in got if not torch.equal(got[k], want[k])] == []


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
