"""Turn a built model's linear layers into FP8-executing ones, in place, before DDP wraps them.

Each converted megatron parallel linear gets its class swapped (:mod:`~loong.core.engines.megatron.linear_swap`)
for a subclass whose ``_forward_impl`` runs :class:`~loong.core.precision.fp8_linear.FP8LinearFunction` instead;
:func:`remove_fp8` swaps the classes back.

Kept in high precision: the output layer (``output_layer``, whose logits feed the loss), layers without
a weight of their own, norms (not linear layers), layers named in ``precision.fp8_exclude`` and, natively,
layers whose dimensions ``torch._scaled_mm`` cannot take (multiples of 16; 128 for blockwise). Deferred
embedding weight gradients and GTP-sharded weights fall back to megatron's own path per call.

With Transformer Engine's layer spec, the linear layers are TE modules: FP8 then goes through TE's own
recipes via megatron's ``TransformerConfig.fp8`` / ``fp8_recipe`` (tensorwise and blockwise only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from loong.core.accelerators.base import Accelerator
from loong.core.config.schema import PrecisionConfig
from loong.core.engines.megatron.linear_swap import is_te_linear, linear_call, restore_classes, with_mixin
from loong.core.engines.megatron.state import unwrap
from loong.core.errors import LoongError
from loong.core.precision.adaptive import SpeedupTable, table_for
from loong.core.precision.fp8_linear import FP8LinearFunction
from loong.core.precision.plan import (  # noqa: F401  (check_precision, summarize: this module's API since before)
    Candidate,
    LayerPlan,
    check_precision,
    plan_layers,
    recipe_of,
    summarize,
    warn_if_emulated,
)
from loong.core.precision.recipes import RECIPES, FP8Recipe


class FP8LinearMixin:
    """``_forward_impl`` with fp8 GEMMs; everything else is the megatron layer's own."""

    fp8_recipe: FP8Recipe
    fp8_native: bool

    def _forward_impl(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # megatron's own ``gradient_accumulation_fusion`` flag decides whether dW goes to main_grad here
        comm = linear_call(self, args, kwargs, fuse_wgrad=bool(kwargs.get("gradient_accumulation_fusion")))
        if comm is None:  # features this path does not implement: megatron's bf16 path for this call
            return super()._forward_impl(*args, **kwargs)  # type: ignore[misc]
        return FP8LinearFunction.apply(kwargs["input"], kwargs["weight"], kwargs.get("bias"), self.fp8_recipe,
                                       comm, self.fp8_native)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, fp8={self.fp8_recipe.name}{'' if self.fp8_native else ' (emulated)'}"


class FP8ColumnParallelLinear(FP8LinearMixin, ColumnParallelLinear):
    """A ``ColumnParallelLinear`` whose GEMMs run in fp8."""


class FP8RowParallelLinear(FP8LinearMixin, RowParallelLinear):
    """A ``RowParallelLinear`` whose GEMMs run in fp8."""


_FP8_CLASSES: dict[type, type] = {ColumnParallelLinear: FP8ColumnParallelLinear,
                                  RowParallelLinear: FP8RowParallelLinear}


def convert_to_fp8(module: torch.nn.Module, recipe: FP8Recipe, native: bool = True) -> None:
    """Make one megatron parallel linear run its GEMMs in ``recipe`` (``native=False``: emulated)."""
    if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
        raise TypeError(f"convert_to_fp8 takes megatron's parallel linear layers, not {type(module).__name__}")
    module.__class__ = with_mixin(type(module), FP8LinearMixin, "FP8", _FP8_CLASSES)  # e.g. LoRA's: FP8 below
    module.fp8_recipe, module.fp8_native = recipe, native  # type: ignore[attr-defined]


def remove_fp8(chunks: Iterable[torch.nn.Module]) -> int:
    """Swap every converted layer back to its original class; returns how many there were."""
    restored = restore_classes(chunks, FP8LinearMixin)
    for module in restored:
        del module.fp8_recipe, module.fp8_native
    return len(restored)


def plan_fp8(chunks: Iterable[torch.nn.Module], precision: PrecisionConfig, tokens: int, *,
             table: SpeedupTable | None = None, native: bool = True) -> list[LayerPlan]:
    """Decide, for every megatron linear layer of ``chunks``, whether and how it runs in fp8
    (:func:`~loong.core.precision.plan.plan_layers`; the output layer stays bf16).

    ``tokens``: rows of a layer's input per micro-batch (sequence length x micro-batch size). ``table``
    is required for ``adaptive``. ``native=False`` (emulation) lifts the dimension rules.
    """
    if precision.fp8 == "adaptive" and table is None:
        raise ValueError("plan_fp8: precision.fp8=adaptive needs a speedup table")
    return plan_layers((Candidate(name if i == 0 else f"chunk{i}.{name}", name,
                                  None if module.weight is None else tuple(module.weight.shape),
                                  "output layer" if name.rsplit(".", 1)[-1] == "output_layer" else None)
                        for i, chunk in enumerate(chunks) for name, module in unwrap(chunk).named_modules()
                        if isinstance(module, ColumnParallelLinear | RowParallelLinear)),
                       precision, tokens, table=table, native=native)


def convert_linears(chunks: list[torch.nn.Module], plans: Iterable[LayerPlan], native: bool = True) -> int:
    """Apply ``plans`` (from :func:`plan_fp8` on the same chunks); returns the number of fp8 layers."""
    by_name = {p.name: p for p in plans if p.recipe is not None}
    n = 0
    for i, chunk in enumerate(chunks):
        for name, module in unwrap(chunk).named_modules():
            plan = by_name.get(name if i == 0 else f"chunk{i}.{name}")
            if plan is not None:
                convert_to_fp8(module, RECIPES[plan.recipe], native)  # type: ignore[index]
                n += 1
    return n


def _enable_te_fp8(models: list[torch.nn.Module], precision: PrecisionConfig) -> str:
    """FP8 of Transformer Engine's layers through megatron's config (read by its forward, per layer)."""
    if precision.fp8 not in ("tensorwise", "blockwise"):
        raise LoongError(f"precision.fp8={precision.fp8} is not one of Transformer Engine's recipes here; with TE "
                         "use precision.fp8=tensorwise or blockwise (or uninstall TE for Loong's own recipes)")
    for m in models:
        m.config.fp8 = "hybrid" if precision.fp8 == "tensorwise" else "e4m3"
        m.config.fp8_recipe = precision.fp8
    return f"fp8: Transformer Engine's {precision.fp8} recipe on its linear layers (TransformerConfig.fp8)"


def _shared_table(shapes: set[tuple[int, int, int]], recipe: FP8Recipe, device: torch.device,
                  precision: PrecisionConfig, echo: Callable[[str], None]) -> SpeedupTable:
    """Rank 0 loads or probes the table and sends it to every rank, so all ranks decide alike."""
    def build() -> SpeedupTable:
        return table_for(shapes, recipe, device, probe_missing=precision.fp8_probe, path=precision.fp8_table,
                         echo=echo)

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return build()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = build().to_json()
        except Exception as exc:  # every rank must leave the broadcast, then all raise
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return SpeedupTable.from_json(box[0])


def _enable_fp8_output_layer(models: list[torch.nn.Module], say: Callable[[str], None]) -> None:
    """``precision.fp8_output_layer``: each chunk's own hook (loong-llm's ``LoongGPTModel.enable_fp8_output_layer``,
    which the VLM foundations inherit) switches the fused loss to FP8, or says why it cannot."""
    hooks = [getattr(m, "enable_fp8_output_layer", None) for m in models]
    if any(hook is None for hook in hooks):
        names = sorted({type(m).__name__ for m, hook in zip(models, hooks, strict=True) if hook is None})
        raise LoongError(f"precision.fp8_output_layer=true: {', '.join(names)} has no FP8 output layer (loong-llm's "
                         "GPT models and loong-vlm's foundations have); set precision.fp8_output_layer=false")
    if [hook() for hook in hooks].count(True):
        say("fp8: output layer: logits and input-gradient GEMMs in fp8 (tensorwise, precision.fp8_output_layer); "
            "its weight gradient in bf16")


def apply_fp8(chunks: list[torch.nn.Module], cfg: Any, accelerator: Accelerator, local_rank: int = 0,
              echo: Callable[[str], None] | None = print) -> list[LayerPlan]:
    """The engine's hook: convert ``chunks`` (before DDP) as ``cfg.precision`` says and log the plan.

    ``cfg`` is the run config (``precision``, ``train.seq_length``/``micro_batch_size``, ``parallel.cp``);
    ``echo`` prints on the logging rank (None elsewhere).
    """
    precision: PrecisionConfig = cfg.precision
    if precision.fp8 == "off":
        return []
    say = echo or (lambda _line: None)
    models = [unwrap(c) for c in chunks]
    if precision.fp8_output_layer:
        _enable_fp8_output_layer(models, say)
    if any(is_te_linear(m) for model in models for m in model.modules()):
        say(_enable_te_fp8(models, precision))
        return []
    device = accelerator.device(local_rank)
    tokens = cfg.train.seq_length // max(cfg.parallel.cp, 1) * cfg.train.micro_batch_size
    recipe = recipe_of(precision)
    table = None
    if precision.fp8 == "adaptive":
        shapes = {(tokens, p.n, p.k) for p in plan_fp8(models, PrecisionConfig(fp8=recipe.name, fp8_exclude=
                  precision.fp8_exclude), tokens) if p.recipe is not None}
        table = _shared_table(shapes, recipe, device, precision, say)
    plans = plan_fp8(models, precision, tokens, table=table)
    convert_linears(models, plans)
    for line in summarize(plans):
        say(line)
    warn_if_emulated(recipe, device)
    return plans
