"""The fsdp engine against one process: toy LLaMA- and DiT-like models (``workers/toy_tasks.py``) trained at
FSDP dp_shard=2, HSDP 2x1 and 1x2, DDP, with recomputation full/selective, frozen parameters and CPU offload give the
single-process losses, gradients (after clipping across shards) and weights over 10 steps (fp32, 1e-5), and with
``train.ema_decay`` the moving averages of the weights, which equal the hand-computed recursion. So do
context-parallel layouts (world 4): Ulysses 2, ring 2, Ulysses x ring 2x2, ring under HSDP, Ulysses under DDP,
with the DiT's bidirectional self-attention and its cross-attention to the replicated text, and the LLaMA's causal
attention. A checkpoint saved at dp_shard=2 resumes at one process and at HSDP 2x1 with the uninterrupted run's
next loss.

Three process launches in all: the world-2 cases, the world-4 cases, the references in one plain process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKERS = Path(__file__).parent / "workers"
WORKER = WORKERS / "fsdp_layouts.py"

REFERENCES = ["llama-single", "llama-single-frozen", "dit-single", "dit-single-frozen", "reshard_single",
              "llama-single-ema", "dit-single-ema", "llama-ddp1-graphs"]
CASES = {  # world-2 case -> its single-process reference
    "llama-full": "llama-single",
    "llama-hybrid2x1": "llama-single",
    "llama-hybrid1x2": "llama-single",
    "llama-ddp": "llama-single",
    "llama-full-recompute_full": "llama-single",
    "llama-hybrid2x1-recompute_selective": "llama-single",
    "llama-full-frozen": "llama-single-frozen",
    "llama-ddp-frozen": "llama-single-frozen",
    "dit-full": "dit-single",
    "dit-hybrid2x1": "dit-single",
    "dit-ddp-recompute_selective": "dit-single",
    "dit-full-recompute_full": "dit-single",
    "dit-full-frozen": "dit-single-frozen",
    "dit-hybrid1x2-offload": "dit-single",
    "llama-full-ema": "llama-single-ema",
    "dit-ddp-ema": "dit-single-ema",
    "llama-ddp-graphs": "llama-single",
    "dit-ddp-graphs": "dit-single",
}
#: one-process cases compared like the world-2 ones
SINGLE_CASES = {"llama-ddp1-graphs": "llama-single"}
CP_CASES = {  # world-4 case -> its single-process reference
    "dit-ulysses2": "dit-single",
    "dit-ring2": "dit-single",
    "dit-ulysses2xring2": "dit-single",
    "dit-hybrid2x1ring2": "dit-single",
    "dit-ddpulysses2": "dit-single",
    "llama-ring2": "llama-single",
    "llama-ulysses2xring2": "llama-single",
}
RESHARD = ["reshard_save", "reshard_hybrid2x1"]


def _run(cmd: list[str], timeout: int = 600) -> None:
    # without the rendezvous variables an in-process run of this pytest process may have left behind
    env = {k: v for k, v in os.environ.items() if k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_layouts")
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
          str(out), *CASES, *RESHARD])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(WORKER),
          str(out), *CP_CASES])
    _run([sys.executable, str(WORKER), str(out), *REFERENCES])
    return out


def _load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


def _close(a: object, b: object, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", sorted(CASES) + sorted(CP_CASES) + sorted(SINGLE_CASES))
def test_layout_equals_one_process(results: Path, case: str) -> None:
    got, ref = _load(results, case), _load(results, {**CASES, **CP_CASES, **SINGLE_CASES}[case])
    _close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), "losses over 10 steps")
    _close(torch.tensor(got["grad_norm"]), torch.tensor(ref["grad_norm"]), "grad norms")
    for step in (0, 9):
        assert got["grads"][step].keys() == ref["grads"][step].keys()
        for name, grad in ref["grads"][step].items():
            _close(got["grads"][step][name], grad, f"step {step + 1} gradient of {name}")
    assert got["weights"].keys() == ref["weights"].keys()
    for name, weight in ref["weights"].items():
        _close(got["weights"][name], weight, f"final {name}")
    assert ref["loss"][-1] < ref["loss"][0]  # the toy learns: 10 steps of something, not of nothing


def test_frozen_parameters_have_no_gradient_and_no_optimizer_state(results: Path) -> None:
    for name in ("llama-full-frozen", "llama-single-frozen", "llama-ddp-frozen"):
        frozen = _load(results, name)
        whole = _load(results, name.replace("-frozen", "") if "single" in name else "llama-single")
        grads = frozen["grads"][0]
        assert not any(k.startswith(("embed", "layers.0.attn")) for k in grads), name
        assert "layers.1.attn.q.weight" in grads
        n_frozen = sum(k.startswith(("embed", "layers.0.attn")) for k in frozen["weights"])
        assert n_frozen == 6  # the embedding, layer 0's attention norm and its q, k, v, o
        assert frozen["optimizer_params"] == whole["optimizer_params"] - n_frozen
        assert frozen["optimizer_state"] == frozen["optimizer_params"]
        single = _load(results, "llama-single-frozen")
        for k in ("embed.weight", "layers.0.attn.q.weight"):  # untouched by 10 steps
            torch.testing.assert_close(frozen["weights"][k], single["weights"][k], rtol=0, atol=0)


def test_resume_reshards_from_two_shards_to_one_process_and_to_hybrid(results: Path) -> None:
    uninterrupted = _load(results, "reshard_save")  # 6 steps in one go; it also saved step 5
    for name in ("reshard_single", "reshard_hybrid2x1"):
        resumed = _load(results, name)
        assert resumed["last_step"] == 6
        assert abs(resumed["last_loss"] - uninterrupted["last_loss"]) <= 1e-5, name


@pytest.mark.parametrize("case", ["llama-single-ema", "dit-single-ema", "llama-full-ema", "dit-ddp-ema"])
def test_ema_is_the_moving_average_of_the_weights(results: Path, case: str) -> None:
    """ema_0 = the initial weights, ema_k = d·ema_(k−1) + (1 − d)·w_k after step k, computed here in float64 from
    the weights the worker saw after every step; sharded (FSDP over 2 ranks) and DDP averages equal one process's."""
    sys.path.insert(0, str(WORKERS))
    from fsdp_layouts import EMA_DECAY

    got = _load(results, case)
    trajectory = got["trajectory"]
    assert len(trajectory) == 11 and sorted(got["ema"]) == sorted(got["weights"])
    for name, final in got["ema"].items():
        want = trajectory[0][name].double()
        for weights in trajectory[1:]:
            want = EMA_DECAY * want + (1 - EMA_DECAY) * weights[name].double()
        torch.testing.assert_close(final.double(), want, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        if name.endswith(".weight"):  # the average trails the trained weights: not a copy of them or of the start
            assert not torch.allclose(final, got["weights"][name]) and not torch.allclose(final, trajectory[0][name])
    if "single" not in case:
        ref = _load(results, case.replace("-full-", "-single-").replace("-ddp-", "-single-"))
        for name, average in ref["ema"].items():
            _close(got["ema"][name], average, f"moving average of {name}")


@pytest.mark.parametrize("case", ["llama-ddp-graphs", "dit-ddp-graphs", "llama-ddp1-graphs"])
def test_cuda_graph_cases_replayed_every_micro_batch_after_the_first(results: Path, case: str) -> None:
    """The graph cases above equal the eager reference; here: they did go through one capture and replays (10
    steps of 2 micro-batches at world 2, of 4 in one process; one batch shape, so one graph)."""
    got = _load(results, case)["graphs"]
    micro_batches = 10 * (4 if case.endswith("ddp1-graphs") else 2)
    assert got == {"graphs": 1, "eager": 0, "captures": 1, "replays": micro_batches}
