"""``train.cuda_graphs``' bookkeeping (``loong.core.engines.fsdp.cuda_graph.StepGraphs``) on the CPU, with a backend
that replays by running the step again (``workers/graph_replay.py``): micro-batches of two shapes alternating within
a step give plain autograd's accumulated gradients bit for bit (a second capture in mid-step keeps what the first
micro-batch added), dropout draws what the eager step draws (the random state is restored after the warm-up),
shapes beyond the limit run eagerly and are counted, and the signature tells batches apart by every shape and every
host value. The engine refuses the layouts it cannot capture. The whole engine with graphs against one process and
DDP is in ``test_fsdp_engine.py`` (``-graphs`` cases); the real capture is ``test_gpu_cuda_graphs.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from graph_replay import EagerReplayBackend  # noqa: E402
from toy_tasks import toy_config  # noqa: E402

from loong.core.engines.fsdp import cuda_graph  # noqa: E402
from loong.core.engines.fsdp.cuda_graph import StepGraphs, signature  # noqa: E402
from loong.core.engines.fsdp.engine import FSDPEngine  # noqa: E402
from loong.core.errors import LoongError  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    shapes = [4, 7, 4, 7]  # two shapes, alternating: the second is captured at micro-batch 1
    return [{"x": torch.randn(n, 6, generator=g), "y": torch.randn(n, 3, generator=g)} for n in shapes]


def _eager_grads(steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Every micro-batch's loss and every step's accumulated gradients (no optimiser: the weights stay)."""
    model, losses, grads = _model(), [], []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        for m, batch in enumerate(_batches()):
            torch.manual_seed(100 * step + m)  # what the task's prepare() does before every micro-batch
            loss = _loss(model, batch)
            (loss * 0.25).backward()
            losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return losses, grads


def _graphed_grads(steps: int, backend: EagerReplayBackend) -> tuple[list[float], list[dict[str, torch.Tensor]],
                                                                      StepGraphs]:
    model, losses, grads = _model(), [], []

    def step(batch: dict, scale: torch.Tensor) -> torch.Tensor:
        loss = _loss(model, batch)
        (loss * scale).backward()
        return loss.detach()

    graphs = StepGraphs(step, list(model.parameters()), backend)
    for s in range(steps):
        graphs.zero_grads()
        for m, batch in enumerate(_batches()):
            torch.manual_seed(100 * s + m)
            losses.append(float(graphs.run(batch, 0.25, first=m == 0)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return losses, grads, graphs


def test_graphed_micro_batches_equal_plain_autograd_bit_for_bit() -> None:
    want_losses, want = _eager_grads(2)
    backend = EagerReplayBackend()
    got_losses, got, graphs = _graphed_grads(2, backend)
    assert got_losses == want_losses  # dropout's draws too: the warm-up's were undone
    for step in range(2):  # step 1 captures both shapes (the second in mid-step), step 2 only replays
        for name, grad in want[step].items():
            assert torch.equal(got[step][name], grad), (step, name)
    assert graphs.num_graphs == 2 and graphs.num_eager == 0
    assert backend.captures == 2 and backend.warmups == 2 * cuda_graph.WARMUP_ITERS and backend.replays == 8
    # every gradient is a view of the one buffer the graphs write into
    assert sum(g.numel() for g in got[-1].values()) == graphs.flat.numel()


def test_shapes_beyond_the_limit_run_eagerly_and_are_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graph, "MAX_GRAPHS", 1)
    said: list[str] = []
    model = _model()

    def step(batch: dict, scale: torch.Tensor) -> torch.Tensor:
        loss = _loss(model, batch)
        (loss * scale).backward()
        return loss.detach()

    graphs = StepGraphs(step, list(model.parameters()), EagerReplayBackend(), said.append)
    graphs.zero_grads()
    for m, batch in enumerate(_batches()):
        torch.manual_seed(m)
        graphs.run(batch, 0.25, first=m == 0)
    assert graphs.num_graphs == 1 and graphs.num_eager == 2
    assert len([m for m in said if "more than 1 batch shapes" in m]) == 1
    want_losses, want = _eager_grads(1)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, want[0][name]), name


def test_signature_tells_shapes_dtypes_and_host_values_apart() -> None:
    """Tensors on the graph's device count by shape and dtype; tensors elsewhere (on the host, beside a GPU) and
    other values by value. Here the "device" is the meta device, so the CPU tensors are the host's."""
    meta = torch.device("meta")
    base = {"x": torch.zeros(2, 3, device=meta), "n": 4, "ids": torch.tensor([1, 2])}
    assert signature(base, meta) == signature({"x": torch.ones(2, 3, device=meta), "n": 4,
                                               "ids": torch.tensor([1, 2])}, meta)
    for other in ({**base, "x": torch.zeros(3, 3, device=meta)},
                  {**base, "x": torch.zeros(2, 3, dtype=torch.float64, device=meta)},
                  {**base, "n": 5}, {**base, "ids": torch.tensor([1, 3])}):
        assert signature(other, meta) != signature(base, meta)
    with pytest.raises(ValueError, match="host tensor"):
        signature({"big": torch.zeros(cuda_graph.MAX_HOST_ELEMENTS + 1)}, meta)


@pytest.mark.parametrize(("section", "value", "message"), [
    ("parallel", {"fsdp": "full"}, "parallel.fsdp=full: FSDP2 gathers"),
    ("model", {"recompute": "full"}, "model.recompute=full: recomputation"),
])
def test_engine_refuses_what_it_cannot_capture(section: str, value: dict, message: str) -> None:
    base = {"parallel": {"fsdp": "none"}, "model": {}}
    cfg = toy_config(task="toy.llama", train={"cuda_graphs": True}, **{**base, section: value})
    with pytest.raises(LoongError, match=message):
        FSDPEngine.check_config(cfg)


def test_engine_without_graph_capture_says_so() -> None:
    """The CPU accelerator has no graphs: the engine says so when the layout is asked for, before anything is
    built or written."""
    from loong.core.accelerators import select_accelerator

    cfg = toy_config(task="toy.llama", train={"cuda_graphs": True}, parallel={"fsdp": "none"})
    FSDPEngine.check_config(cfg)  # the toy task declares its step capture-safe
    with pytest.raises(LoongError, match="the cpu accelerator has no graph capture"):
        FSDPEngine.init_layout(select_accelerator("cpu"), cfg)
