"""The fsdp engine's checkpoints: torch DCP (``torch.distributed.checkpoint``), sharded and layout-independent.

The state is torch's own ``get_state_dict(model, optimizer)``: keys are the bare model's parameter names
(wrappers stripped), each value a DTensor (FSDP2) or a whole tensor (DDP); the optimiser's state is keyed by
the same names. DCP saves each rank's shards once (replicas write nothing twice) and loads them into whatever
layout the resuming run has: a dp_shard=2 checkpoint resumes at dp_shard=1, under HSDP or under DDP. Frozen
parameters are in the model state only; the optimiser holds none for them. With ``train.ema_decay`` the moving
averages of the trainable weights are saved too, as ``ema.<name>`` (:mod:`.ema`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from loong.core.engines.base import PendingSave
from loong.core.engines.fsdp.ema import WeightEMA
from loong.core.errors import LoongError

#: the top-level key of the weights' moving averages in a checkpoint
EMA_KEY = "ema"


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                   ema: WeightEMA | None = None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` (and ``"ema"``) as DCP saves and loads it."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    if ema is not None:
        state[EMA_KEY] = ema.state_dict()
    return state


def saved_tensors(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor a DCP checkpoint holds, by flattened key (``model.<name>``, ``optimizer.state.<name>.<k>``),
    with its global shape."""
    meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {k: tuple(getattr(v, "size", ())) for k, v in meta.items()}


def check_same_model(directory: Path, model_sd: dict[str, Any], allow_missing: bool) -> set[str]:
    """Refuse a checkpoint of another model, naming the differing keys; returns the model keys it lacks (only
    allowed with ``allow_missing``, for weights-only checkpoints)."""
    saved = {k[len("model."):]: shape for k, shape in saved_tensors(directory).items() if k.startswith("model.")}
    ours = {k: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(ours) - set(saved))
    unexpected = sorted(set(saved) - set(ours))
    reshaped = sorted(k for k in set(ours) & set(saved) if ours[k] != saved[k])
    problems = []
    if missing and not allow_missing:
        problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"not in this model {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if reshaped:
        problems.append("other shapes " + ", ".join(f"{k} {saved[k]} vs {ours[k]}" for k in reshaped[:5]))
    if problems:
        raise LoongError(f"{directory} holds another model's weights: {'; '.join(problems)}")
    return set(missing)


def save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, ema: WeightEMA | None = None) -> None:
    """Collective: write the model and optimiser shards (and the EMA's) under ``directory``."""
    dcp.save(training_state(model, optimizer, ema), checkpoint_id=str(directory))


def _holds_ema(directory: Path, ema: WeightEMA) -> bool:
    """Whether ``directory`` holds this EMA's averages (False: none at all); a partial or other set is refused."""
    prefix = f"{EMA_KEY}."
    saved = {k[len(prefix):] for k in saved_tensors(directory) if k.startswith(prefix)}
    if not saved:
        return False
    ours = set(ema.names)
    if saved != ours:
        missing, extra = sorted(ours - saved), sorted(saved - ours)
        raise LoongError(f"{directory} holds the moving averages (train.ema_decay) of other parameters: "
                         f"missing {missing[:5]}, not trained here {extra[:5]}")
    return True


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, load_optimizer: bool,
         allow_missing: bool, ema: WeightEMA | None = None) -> bool:
    """Collective: read ``directory`` into the model (and optimiser, and EMA) at this run's layout. Returns whether
    the EMA's averages came from the checkpoint (False: it holds none, e.g. a weights-only ``convert`` checkpoint
    or a run without ``train.ema_decay``; the caller restarts the averages at the loaded weights)."""
    with_ema = ema is not None and _holds_ema(directory, ema)
    if load_optimizer:
        state = training_state(model, optimizer, ema if with_ema else None)
    else:
        # weights only (a ``convert`` checkpoint): the model's state alone. get_state_dict(model, optimizer) would
        # give a fresh optimiser state by stepping it once with zero gradients, and Adam would then count that step
        state = {"model": get_model_state_dict(model)}
        if with_ema:
            state[EMA_KEY] = ema.state_dict()
    absent = check_same_model(directory, state["model"], allow_missing)
    for key in absent:
        del state["model"][key]
    dcp.load(state, checkpoint_id=str(directory))  # the EMA's tensors are loaded in place
    options = StateDictOptions(strict=not absent)
    if load_optimizer:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)
    else:
        set_model_state_dict(model, state["model"], options=options)
    return with_ema


class DCPPendingSave(PendingSave):
    """A ``dcp.async_save`` in flight; ``finish`` agrees over all ranks that every write ended."""

    def __init__(self, future: Any, finalize: Callable[[], None], device: torch.device) -> None:
        self.future: Future = getattr(future, "upload_completion", future)  # torch >= 2.9 may return a response
        self.finalize, self.device = finalize, device

    def finish(self, blocking: bool) -> bool:
        if blocking:
            self.future.result()
        done = torch.tensor([1.0 if self.future.done() else 0.0], device=self.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() < 1.0:
            return False
        self.future.result()  # raises here if the write failed
        self.finalize()
        return True


def save_async(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, finalize: Callable[[], None],
               cpu_group: Any, device: torch.device, ema: WeightEMA | None = None) -> DCPPendingSave:
    """Stage the state to host memory now and write it in a background thread (``train.async_save``)."""
    future = dcp.async_save(training_state(model, optimizer, ema), checkpoint_id=str(directory),
                            process_group=cpu_group)
    return DCPPendingSave(future, finalize, device)
