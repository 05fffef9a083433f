"""``train.cuda_graphs``: a micro-batch's forward and backward captured once per batch shape and replayed.

A policy step of small matrices (a VLA's action head, a frozen backbone's forward) launches thousands of short
kernels, and the host that launches them, not the device, sets the pace (docs/embodied.md, "Speed"). A CUDA graph
launches the whole micro-batch at once. How it is done here:

- **Per batch shape.** The first micro-batch of a new shape signature (every tensor's shape, dtype and device, and
  every non-tensor value) is captured: its tensors are copied into input buffers the graph owns, the step runs a
  few times eagerly on a side stream (libraries set up their workspaces), then once under capture. Every later
  micro-batch of that signature is copied into the buffers and the graph replayed. At most :data:`MAX_GRAPHS`
  signatures are captured (one memory pool, shared); a run with more shapes steps the rest eagerly and says so.
- **Gradients in one flat buffer.** Every trainable parameter's ``.grad`` is a view of one buffer, allocated
  before the first capture and never freed (``set_to_none`` would free what the graph writes into), so the
  captured backward accumulates into the same memory at every replay and the micro-batches of a step add up.
  ``zero_grads`` clears it; the warm-up and the capture leave it as it was (a capture records, the warm-up's
  gradients are undone).
- **No DDP inside the graph.** Data-parallel ranks all-reduce the flat buffer once after the step's last
  micro-batch (:meth:`StepGraphs.reduce_gradients`); DDP's bucketed overlap would need its hooks inside the graph.
- **The host part stays outside.** The task's :meth:`~loong.core.engines.fsdp.task.FSDPTask.prepare` (seeding,
  host-side draws) runs before every replay; the random state it leaves is restored before the first replay of a
  new capture, so a captured micro-batch draws what the eager one would.

The capture itself is the accelerator's (:class:`GraphBackend`, :meth:`Accelerator.graph_backend`): this module
only keeps the books, so its logic runs on the CPU in tests with a backend that replays by calling the step again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

#: at most this many batch-shape signatures get a graph; micro-batches of further shapes run eagerly
MAX_GRAPHS = 8
#: host tensors in a batch are part of its signature by value, up to this many elements
MAX_HOST_ELEMENTS = 4096
#: eager iterations before a capture
WARMUP_ITERS = 2

StepFn = Callable[[Any, torch.Tensor], torch.Tensor]


class GraphBackend(Protocol):
    """What an accelerator offers for capturing: a graph of the work ``fn`` queues, replayable."""

    def warmup(self, fn: Callable[[], Any], iters: int) -> None:
        """Run ``fn`` ``iters`` times the way it will be captured (e.g. on the capture's stream)."""

    def capture(self, fn: Callable[[], Any], pool: Any | None) -> tuple[Any, Any]:
        """``(graph, outputs)``: ``fn``'s work recorded (its outputs are the graph's output tensors) in the
        memory ``pool`` of an earlier graph, or a new pool when None."""

    def replay(self, graph: Any) -> None:
        """Run the recorded work again (reading the captured input buffers, writing the outputs)."""

    def pool(self, graph: Any) -> Any:
        """The memory pool of ``graph`` (for the next capture to share)."""

    def rng_state(self) -> Any:
        """The random state a replay draws from (to restore after a warm-up)."""

    def set_rng_state(self, state: Any) -> None:
        """Restore :meth:`rng_state`."""


def _leaves(batch: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(batch, dict):
        for k in sorted(batch, key=str):
            yield from _leaves(batch[k], f"{path}.{k}")
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, batch


def signature(batch: Any, device: torch.device) -> tuple:
    """What must be equal for a captured graph to serve ``batch``: the shape and dtype of each tensor on
    ``device`` (the graph's inputs), and the value of everything else (tensors elsewhere included: the code may
    read them on the host)."""
    parts: list[tuple] = []
    for path, leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.device == device:
            parts.append((path, tuple(leaf.shape), leaf.dtype))
        elif isinstance(leaf, torch.Tensor):
            if leaf.numel() > MAX_HOST_ELEMENTS:
                raise ValueError(f"batch{path}: a host tensor of {leaf.numel()} elements in a captured step; move it "
                                 "to the device in the task's batches or leave train.cuda_graphs off")
            parts.append((path, tuple(leaf.shape), leaf.dtype, tuple(leaf.flatten().tolist())))
        else:
            parts.append((path, type(leaf).__name__, repr(leaf)))
    return tuple(parts)


def _static_copy(batch: Any, device: torch.device) -> Any:
    """The graph's own input buffers: the tensors on ``device`` copied, everything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().clone() if batch.device == device else batch
    if isinstance(batch, dict):
        return {k: _static_copy(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_static_copy(v, device) for v in batch)
    return batch


def _fill(static: Any, batch: Any, device: torch.device) -> None:
    """Copy ``batch``'s tensors on ``device`` into the buffers of ``static`` (same signature)."""
    if isinstance(static, torch.Tensor):
        if static.device == device:
            static.copy_(batch, non_blocking=True)
    elif isinstance(static, dict):
        for k, v in static.items():
            _fill(v, batch[k], device)
    elif isinstance(static, (list, tuple)):
        for s, b in zip(static, batch, strict=True):
            _fill(s, b, device)


class _Captured:
    """One signature's graph: its input buffers and its output (the detached loss)."""

    def __init__(self, graph: Any, inputs: Any, loss: torch.Tensor) -> None:
        self.graph, self.inputs, self.loss = graph, inputs, loss


class StepGraphs:
    """Captured forward + backward of micro-batches, keyed by batch signature (see the module docstring).

    ``step(batch, scale) -> detached loss`` computes the micro-batch's loss, calls ``(loss * scale).backward()``
    and returns ``loss.detach()``; ``scale`` is a device scalar this object fills (``1 / micro-batches``).
    ``params``: the trainable parameters (their gradients become views of one buffer). ``echo``: one line per
    capture and one when a signature beyond :data:`MAX_GRAPHS` first runs eagerly.
    """

    def __init__(self, step: StepFn, params: list[torch.nn.Parameter], backend: GraphBackend,
                 echo: Callable[[str], None] = lambda _m: None) -> None:
        self._step, self._backend, self._echo = step, backend, echo
        self._graphs: dict[tuple, _Captured] = {}
        self._pool: Any = None
        self._eager_warned = False
        self.num_eager = 0
        self.device = device = params[0].device
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
        offset = 0
        for p in params:  # one dtype: the fsdp engine keeps fp32 weights under DDP
            if p.dtype != self.flat.dtype:
                raise ValueError(f"train.cuda_graphs: parameters of dtypes {self.flat.dtype} and {p.dtype}")
            p.grad = self.flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()

    @property
    def num_graphs(self) -> int:
        """How many signatures have a graph."""
        return len(self._graphs)

    def zero_grads(self) -> None:
        """Clear every gradient in place (the graphs write into this memory)."""
        self.flat.zero_()

    def run(self, batch: Any, scale: float, first: bool) -> torch.Tensor:
        """One micro-batch's forward and backward (gradients added to the buffer); its detached loss, a tensor of
        its own. ``first``: the step's first micro-batch (the buffer holds nothing yet)."""
        self.scale.fill_(scale)
        key = signature(batch, self.device)
        captured = self._graphs.get(key)
        if captured is None and len(self._graphs) < MAX_GRAPHS:
            captured = self._capture(key, batch, first)
        if captured is None:
            self.num_eager += 1
            if not self._eager_warned:
                self._eager_warned = True
                self._echo(f"train.cuda_graphs: more than {MAX_GRAPHS} batch shapes; micro-batches of further shapes "
                           "run without a graph (pad batches to a few fixed shapes to graph them all)")
            return self._step(batch, self.scale).clone()
        _fill(captured.inputs, batch, self.device)
        self._backend.replay(captured.graph)
        return captured.loss.clone()

    def _capture(self, key: tuple, batch: Any, first: bool) -> _Captured:
        inputs = _static_copy(batch, self.device)
        saved = None if first else self.flat.clone()  # what the step's earlier micro-batches added
        rng = self._backend.rng_state()  # what prepare() left: the replay below must draw from it

        def restore() -> None:
            if saved is None:
                self.flat.zero_()
            else:
                self.flat.copy_(saved)
            self._backend.set_rng_state(rng)

        def step() -> torch.Tensor:
            return self._step(inputs, self.scale)

        self._backend.warmup(step, WARMUP_ITERS)
        restore()
        graph, loss = self._backend.capture(step, self._pool)
        restore()  # a capture records without running, but a backend may run it; either way, as before
        if self._pool is None:
            self._pool = self._backend.pool(graph)
        captured = self._graphs[key] = _Captured(graph, inputs, loss)
        self._echo(f"train.cuda_graphs: captured the step for batch shape {len(self._graphs)} "
                   f"({sum(isinstance(v, torch.Tensor) for _, v in _leaves(batch))} tensors)")
        return captured

    def reduce_gradients(self, group: dist.ProcessGroup, in_bf16: bool = False) -> None:
        """Average the gradient buffer over ``group`` (data × context parallelism), once per step."""
        world = dist.get_world_size(group)
        if world == 1:
            return
        if in_bf16:  # as DDP's bf16_compress_hook: divide, reduce in bf16, copy back
            low = self.flat.div(world).to(torch.bfloat16)
            dist.all_reduce(low, group=group)
            self.flat.copy_(low)
            return
        dist.all_reduce(self.flat, group=group)
        self.flat.div_(world)


__all__ = ["MAX_GRAPHS", "GraphBackend", "StepGraphs", "signature"]
