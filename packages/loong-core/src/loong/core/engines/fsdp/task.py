"""What the fsdp engine needs from a task: a plain ``nn.Module`` and a loss."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from loong.core.task import Task

#: Attribute names :meth:`FSDPTask.blocks` looks for, in order (LLaMA/Qwen, DiT/ViT, GPT-2, diffusers).
BLOCK_LISTS = ("layers", "blocks", "h", "transformer_blocks")
#: Attribute names :meth:`FSDPTask.mlp` looks for inside a block.
MLP_NAMES = ("mlp", "ffn", "ff", "feed_forward")


class FSDPTask(Task):
    """A task trained by the ``fsdp`` engine.

    The engine calls :meth:`build_model` once (fp32, on the host), :meth:`init_weights` on a fresh run, then
    applies recomputation, ``torch.compile`` and sharding to each of :meth:`blocks` and to the whole model. Every
    step it moves each micro-batch to the device and calls :meth:`loss`. Parameters the task freezes
    (``requires_grad=False``) get no gradient and no optimiser state.
    """

    engine = "fsdp"
    #: FSDP2 casts the root module's floating-point forward inputs to the compute dtype (bf16). A task whose model
    #: needs some input in fp32 (a diffusion timestep: bf16 holds 999.3 as 1000) sets False and casts the others.
    cast_root_inputs: bool = True

    @classmethod
    def cuda_graph_unsupported(cls, cfg: Any) -> str | None:
        """Why :meth:`loss` on a :meth:`prepare`-d batch of the run ``cfg`` cannot be captured in a CUDA graph
        (``train.cuda_graphs``), or None when it can: no device-to-host sync, no host tensor copied in, no host-side
        draw, the same kernels for every batch of the same shapes. Asked before anything is built or written.
        Default: not declared capture-safe."""
        return f"the task {cls.__name__} does not declare its training step capture-safe"

    def prepare(self, model: nn.Module, batch: Any) -> Any:
        """The host-side part of a micro-batch's step, run before its device part (:meth:`loss`) every time: e.g.
        seeding the generators and the draws a model makes on the host. Under ``train.cuda_graphs`` only
        :meth:`loss` is captured and replayed, so whatever must change from batch to batch without being a tensor
        of the batch belongs here. Default: the batch unchanged."""
        return batch

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The model, in fp32, on the host (the engine moves, shards and casts it)."""

    def init_weights(self, model: nn.Module) -> None:
        """Called once after a fresh build, before sharding (not on resume): e.g. load the field's weights."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks: the units that are sharded, recomputed and compiled one by one.

        Default: the first ``nn.ModuleList`` found under one of :data:`BLOCK_LISTS`, searched breadth-first
        (``model.layers``, ``model.model.layers`` for a ``transformers`` causal LM, ``transformer_blocks``, ...).
        """
        queue = [model]
        while queue:
            module = queue.pop(0)
            for name in BLOCK_LISTS:
                found = getattr(module, name, None)
                if isinstance(found, nn.ModuleList) and len(found):
                    return list(found)
            queue.extend(module.children())
        return []

    def compile_options(self) -> dict[str, Any]:
        """Inductor options for ``train.compile`` (``torch.compile(options=...)``, per block); default none.

        A task sets one where its model meets a measured inductor fault, so the fix stays with the model and leaves
        other tasks' compilation alone.
        """
        return {}

    def fp8_exclude(self) -> list[str]:
        """Names or globs of the model's linear layers that stay in high precision under ``precision.fp8``, besides
        the run's ``precision.fp8_exclude`` (matched like it: the whole dotted name, or its last part). Default none.
        """
        return []

    def mlp(self, block: nn.Module) -> nn.Module | None:
        """The block's feed-forward part, recomputed by ``model.recompute=selective`` (default: the first child
        named in :data:`MLP_NAMES`)."""
        for name in MLP_NAMES:
            found = getattr(block, name, None)
            if isinstance(found, nn.Module):
                return found
        return None

    @abstractmethod
    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The micro-batch's scalar loss (a mean over its samples or tokens) and metrics to log.

        Micro-batches are weighted equally: the step's loss is the mean of the micro-batch losses, averaged
        over data parallelism (and context parallelism, whose ranks each hold an equal part of the sequence).
        """
