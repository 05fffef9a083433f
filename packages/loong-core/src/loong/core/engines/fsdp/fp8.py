"""FP8 linear layers for the fsdp engine's plain ``nn.Module`` models, converted in place before wrapping.

Each converted ``torch.nn.Linear`` gets its class swapped for :class:`FP8Linear`, a subclass whose ``forward`` runs
:class:`~loong.core.precision.fp8_linear.FP8LinearFunction` (the three GEMMs on fp8 operands, no tensor
parallelism) instead of ``F.linear``. Its parameters, their names and the state-dict keys stay what they were and
``isinstance(m, nn.Linear)`` still holds, so checkpoints, exports (lerobot / diffusers / Hugging Face key maps) and
the wrappers that follow (recomputation, ``torch.compile``, ``fully_shard``, DDP) see the same module tree.
:func:`remove_fp8` swaps the classes back.

Which layers: every module whose type is exactly ``nn.Linear`` (a subclass has a forward of its own, which the
swap would replace), unless ``precision.fp8_exclude`` or the task (:meth:`FSDPTask.fp8_exclude`) names it, or its
weight's dimensions are not what ``torch._scaled_mm`` takes (multiples of 16; 128 for blockwise). The rules and the
log are shared with the megatron engine (:mod:`loong.core.precision.plan`).

Precision: under FSDP2's bf16 mixed precision the weight arrives in bf16; under DDP (``parallel.fsdp=none``) it is
the fp32 master weight and the step runs under autocast, which does not reach into an autograd function, so the
forward casts the input, weight and bias to autocast's dtype itself (what autocast does for ``F.linear``) and runs
the function with autocast off. The scales stay on the device: nothing in the forward or backward reads a value
back to the host, so a step with FP8 linears can be captured in a CUDA graph (``train.cuda_graphs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from loong.core.config.schema import PrecisionConfig
from loong.core.errors import LoongError
from loong.core.precision.fp8_linear import FP8LinearFunction, LinearComm
from loong.core.precision.plan import (
    Candidate,
    LayerPlan,
    matches,
    plan_layers,
    recipe_of,
    summarize,
    warn_if_emulated,
)
from loong.core.precision.recipes import RECIPES, FP8Recipe

#: no tensor parallelism: the fsdp engine's layers hold whole weights while they compute
_NO_TP = LinearComm()
#: values of ``precision.fp8`` this engine runs
FSDP_FP8_MODES = ("off", "tensorwise", "rowwise", "blockwise")


class FP8Linear(nn.Linear):
    """An ``nn.Linear`` whose forward and backward GEMMs run in fp8 (made by :func:`convert_to_fp8`, never built)."""

    fp8_recipe: FP8Recipe
    fp8_native: bool

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's parameter name)
        return _fp8_linear(input, self.weight, self.bias, self.fp8_recipe, self.fp8_native)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.name}{'' if self.fp8_native else ' (emulated)'}"


# Opaque to torch.compile: traced, the quantisers' backend dispatch (loong-kernels) breaks the graph about a dozen
# times per layer; as one call, a compiled block is split once per FP8 linear and everything between is fused.
@torch.compiler.disable
def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: FP8Recipe,
                native: bool) -> torch.Tensor:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        # autocast's own cast of F.linear's operands; its cast cache does not reach here, so the fp32 weight is
        # cast once per call (FP8 quantises it per call anyway)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device, enabled=False):
            return FP8LinearFunction.apply(x, weight, bias, recipe, _NO_TP, native)
    return FP8LinearFunction.apply(x, weight, bias, recipe, _NO_TP, native)


def convert_to_fp8(module: nn.Module, recipe: FP8Recipe, native: bool = True) -> None:
    """Make one ``nn.Linear`` run its GEMMs in ``recipe`` (``native=False``: always emulated), in place."""
    if type(module) not in (nn.Linear, FP8Linear):
        raise TypeError(f"convert_to_fp8 takes torch.nn.Linear modules, not {type(module).__name__}")
    module.__class__ = FP8Linear
    module.fp8_recipe, module.fp8_native = recipe, native  # type: ignore[assignment]


def remove_fp8(model: nn.Module) -> int:
    """Swap every converted layer of ``model`` back to ``nn.Linear``; returns how many there were."""
    n = 0
    for module in model.modules():
        if type(module) is FP8Linear:
            module.__class__ = nn.Linear
            del module.fp8_recipe, module.fp8_native
            n += 1
    return n


def plan_fp8(model: nn.Module, precision: PrecisionConfig, task_exclude: Sequence[str] = (), *,
             native: bool = True) -> list[LayerPlan]:
    """Decide, for every ``nn.Linear`` of ``model`` (subclasses included, to say why they stay), whether and how it
    runs in fp8. ``task_exclude``: the task's globs of layers kept in high precision. Tokens per micro-batch are
    not known here (0 in the plan), so ``adaptive`` cannot be planned."""
    if precision.fp8 == "adaptive":
        raise LoongError(adaptive_refusal())
    return plan_layers((Candidate(name, name, tuple(m.weight.shape) if m.weight is not None else None,
                                  _keep_reason(name, m, task_exclude))
                        for name, m in model.named_modules() if isinstance(m, nn.Linear)),
                       precision, 0, native=native)


def _keep_reason(name: str, module: nn.Module, task_exclude: Sequence[str]) -> str | None:
    if type(module) not in (nn.Linear, FP8Linear):
        return f"{type(module).__name__}: a subclass of nn.Linear, with a forward of its own"
    if matches(name, task_exclude):
        return "the task's fp8_exclude"
    return None


def convert_linears(model: nn.Module, plans: list[LayerPlan], native: bool = True) -> int:
    """Apply ``plans`` (from :func:`plan_fp8` on the same model); returns the number of fp8 layers."""
    by_name = {p.name: p for p in plans if p.recipe is not None}
    n = 0
    for name, module in model.named_modules():
        plan = by_name.get(name)
        if plan is not None:
            convert_to_fp8(module, RECIPES[plan.recipe], native)  # type: ignore[index]
            n += 1
    return n


def adaptive_refusal() -> str:
    """Why ``precision.fp8=adaptive`` does not run on the fsdp engine (its error message)."""
    return ("precision.fp8=adaptive: adaptive decides per layer from the layer's GEMM shape, whose rows (tokens per "
            "micro-batch) a plain nn.Module model only shows at its first step, too late to convert before wrapping; "
            f"on the fsdp engine set precision.fp8 to one of {', '.join(FSDP_FP8_MODES)}")


def apply_fp8(model: nn.Module, precision: PrecisionConfig, device: torch.device, task_exclude: Sequence[str] = (),
              echo: Callable[[str], None] | None = print) -> list[LayerPlan]:
    """The engine's hook: convert ``model``'s linear layers (built, before any wrapping) as ``precision`` says and
    log the plan through ``echo`` (None: no log). The start-up check (:func:`~loong.core.precision.plan.
    check_precision`) has run already."""
    if precision.fp8 == "off":
        return []
    plans = plan_fp8(model, precision, task_exclude)
    convert_linears(model, plans)
    for line in summarize(plans) if echo is not None else ():
        echo(line)
    warn_if_emulated(recipe_of(precision), device)
    return plans
