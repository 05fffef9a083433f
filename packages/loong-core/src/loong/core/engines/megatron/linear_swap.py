"""Running megatron's parallel linears through Loong's own autograd functions, by swapping their class in place.

megatron-core's ``ColumnParallelLinear`` and ``RowParallelLinear`` (and subclasses such as LoRA's) do their
tensor-parallel communication around one call, ``self._forward_impl(input=, weight=, bias=, ...)``, with the GEMMs
and their gradient plumbing inside it. A mixin that overrides ``_forward_impl`` changes only that: swapped in place
(:func:`with_mixin`), a layer keeps its parameter names, state-dict and sharded-checkpoint keys, ``isinstance``
checks and the parameters megatron's DDP registers; :func:`restore_classes` swaps back. FP8
(:mod:`~loong.core.engines.megatron.fp8`) and the fused weight-gradient accumulation
(:mod:`~loong.core.engines.megatron.wgrad_fusion`) are two such mixins.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

from loong.core.engines.megatron.state import unwrap
from loong.core.precision.fp8_linear import LinearComm

#: the keyword arguments of megatron's ``_forward_impl`` that Loong's linear functions understand
KNOWN_KWARGS = {"input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
                "grad_output_buffer", "wgrad_deferral_limit", "tp_group", "gtp_remat_size"}


def linear_call(layer: torch.nn.Module, args: tuple, kwargs: dict, *, fuse_wgrad: bool) -> LinearComm | None:
    """The :class:`LinearComm` of one megatron ``_forward_impl`` call, or None when the call uses a feature Loong's
    linear functions do not implement (megatron's own path must run it). ``fuse_wgrad``: accumulate ``dW`` into
    ``main_grad`` inside the function."""
    if args or set(kwargs) - KNOWN_KWARGS or kwargs.get("grad_output_buffer") is not None \
            or kwargs.get("gtp_remat_size", 1) > 1:
        return None
    sp, ar = bool(kwargs.get("sequence_parallel")), bool(kwargs.get("allreduce_dgrad"))
    group = kwargs.get("tp_group")
    if (sp or ar) and group is None:  # RowParallelLinear passes None; it never needs the group
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        group = get_tensor_model_parallel_group_if_none(None, is_expert=getattr(layer, "is_expert", False))
    return LinearComm(sp, ar, group, fuse_wgrad)


def is_te_linear(module: torch.nn.Module) -> bool:
    """A Transformer Engine linear layer (TE runs FP8 and the fused weight-gradient accumulation itself)."""
    cls = type(module)
    te = cls.__module__.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine"))
    return te and "Linear" in cls.__name__


def with_mixin(cls: type, mixin: type, prefix: str, made: dict[type, type]) -> type:
    """``cls`` with ``mixin`` in front (``cls`` itself if it has it): one subclass per class, kept in ``made`` and
    importable by name from the mixin's module (``<prefix><cls name>``), so a converted model still pickles."""
    if issubclass(cls, mixin):
        return cls
    if cls not in made:
        sub = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})
        setattr(sys.modules[mixin.__module__], sub.__name__, sub)
        made[cls] = sub
    return made[cls]


def restore_classes(chunks: Iterable[torch.nn.Module], mixin: type) -> list[Any]:
    """Swap every layer of ``chunks`` that has ``mixin`` back to the class it was made from; returns those layers."""
    restored = []
    for chunk in chunks:
        for module in unwrap(chunk).modules():
            if isinstance(module, mixin):
                module.__class__ = type(module).__bases__[-1]  # (mixin, original)
                restored.append(module)
    return restored
