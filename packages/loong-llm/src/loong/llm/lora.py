"""LoRA: low-rank adapters on megatron-core's tensor-parallel linear layers, applied from outside the model.

``apply_lora`` turns each targeted ``ColumnParallelLinear`` / ``RowParallelLinear`` *in place* into a
subclass that adds ``(alpha/rank) * B(A(dropout(x)))`` to the base output. In place (a class swap, not a
wrapper module) so that every base key stays what it was: HF mapping, checkpoints, megatron's SwiGLU
checkpoint factory (keyed on ``linear_fc1.weight``) and optimiser state keys are unchanged; the adapters
add ``<module>.lora_A.weight`` [rank, in] and ``<module>.lora_B.weight`` [out, rank].

Tensor parallelism, per rank:

- column-parallel (output split): A replicated [rank, in]; B split like the output [out/tp, rank].
  ``h = A x`` passes through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of the
  gradient), so A's gradient and the adapter's input gradient are whole and equal on every TP rank.
- row-parallel (input split): A split like the input [rank, in/tp]; the partial ``A x`` is all-reduced
  over TP, then B (replicated [out, rank]) applies. Sequence parallelism is rejected.

Fused layouts need nothing special: B of ``linear_qkv`` has megatron's per-group QKV row order and B of
``linear_fc1`` the ``cat(gate, up)`` order (checkpointed through the same SwiGLU factory as the base
weight), so ``W + s·B@A`` is exactly the merged fused weight. Every non-adapter parameter is frozen;
megatron's DDP and optimiser skip parameters with ``requires_grad=False``.

Initialisation is layout-independent: each adapter is drawn as a whole tensor from a generator seeded by
(seed, key) and sliced per rank — A uniform in ±1/sqrt(in) (kaiming-uniform with a=sqrt(5)), B zero, so
step 0 equals the base model at any TP/PP.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.mlp import MLP, apply_swiglu_sharded_factory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

from loong.core.engines.megatron.state import load_full_state, sharded_tensors, unwrap
from loong.core.errors import LoongError
from loong.llm.models.config import LoraConfig

A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def is_adapter_key(key: str) -> bool:
    """Whether a (sharded or state-dict) key names a LoRA adapter tensor."""
    return key.endswith((A_SUFFIX, B_SUFFIX))


def lora_scale(cfg: LoraConfig) -> float:
    """The factor ``alpha / rank`` applied to ``B @ A``."""
    return cfg.alpha / cfg.rank


def check_lora_config(cfg: LoraConfig, sequence_parallel: bool = False) -> None:
    """Errors a user can fix in ``model.lora`` (raised before anything heavy starts)."""
    if cfg.rank < 0:
        raise LoongError(f"model.lora.rank={cfg.rank} must be >= 0 (0 disables LoRA)")
    if cfg.rank == 0:
        return
    if not 0.0 <= cfg.dropout < 1.0:
        raise LoongError(f"model.lora.dropout={cfg.dropout} must be in [0, 1)")
    if not cfg.targets or not all(isinstance(t, str) and t for t in cfg.targets):
        raise LoongError(f"model.lora.targets={cfg.targets!r} must be a non-empty list of module names")
    if sequence_parallel:
        raise LoongError("model.lora with parallel.sequence_parallel=true is not supported; "
                         "set parallel.sequence_parallel=false")


class _LoraMixin:
    """Adapter forward and checkpoint metadata shared by the two parallel linear subclasses."""

    lora_A: torch.nn.Linear
    lora_B: torch.nn.Linear
    lora_scale: float
    lora_dropout: float
    lora_swiglu: bool  # B follows a fused SwiGLU fc1's [gate; up] local layout
    _lora_split: tuple[str, int]  # (the TP-split adapter, its split axis)

    def _lora_in(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        """Dropout on the adapter's input. A replicated input takes the default generator (the same
        mask on every TP rank, as megatron's hidden dropout); a TP-split one the model-parallel one."""
        if not self.lora_dropout or not self.training:  # type: ignore[attr-defined]
            return x
        if not split:
            return F.dropout(x, self.lora_dropout, True)
        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.lora_dropout, True)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """The base module's entries plus the adapters: the replicated one as the base module makes
        it, the TP-split one as a TP-sharded tensor (through the SwiGLU factory for a gated fc1)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)  # type: ignore[misc]
        name, axis = self._lora_split
        key = f"{prefix}{name}.weight"
        tp_group, dp_group = self.tp_group, metadata["dp_cp_group"]  # type: ignore[attr-defined]
        st = make_tp_sharded_tensor_for_checkpoint(getattr(self, name).weight, key, axis,
                                                   prepend_offsets=sharded_offsets, tp_group=tp_group,
                                                   dp_cp_group=dp_group)
        if self.lora_swiglu:
            st = apply_swiglu_sharded_factory(st, sharded_offsets, metadata.get("singleton_local_shards", False),
                                              tp_group=tp_group, dp_group=dp_group)
        sd[key] = st
        return sd


class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
    """ColumnParallelLinear + adapter: A replicated, B split over TP like the output."""

    _lora_split = ("lora_B", 0)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = super().forward(input_, weight, runtime_gather_output)
        h = copy_to_tensor_model_parallel_region(F.linear(self._lora_in(input_, False), self.lora_A.weight),
                                                 group=self.tp_group)
        delta = F.linear(h, self.lora_B.weight) * self.lora_scale
        if runtime_gather_output if runtime_gather_output is not None else self.gather_output:
            delta = gather_from_tensor_model_parallel_region(delta, group=self.tp_group)
        return out + delta, bias


class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
    """RowParallelLinear + adapter: A split over TP like the input (partial products all-reduced),
    B replicated."""

    _lora_split = ("lora_A", 1)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = super().forward(input_)
        x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        h = reduce_from_tensor_model_parallel_region(F.linear(self._lora_in(x, True), self.lora_A.weight),
                                                     group=self.tp_group)
        return out + F.linear(h, self.lora_B.weight) * self.lora_scale, bias


def _matches(name: str, targets: Iterable[str]) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return any(t == leaf or fnmatch.fnmatchcase(name, t) for t in targets)


def _attach(module: torch.nn.Module, name: str, cfg: LoraConfig, swiglu: bool) -> None:
    """Swap ``module``'s class for its LoRA subclass and give it adapters (values set later)."""
    if getattr(module, "sequence_parallel", False) or getattr(module, "explicit_expert_comm", False):
        raise LoongError(f"LoRA on {name}: sequence-parallel and expert layers are not supported")
    if module.weight is None:
        raise LoongError(f"LoRA on {name}: the layer has no weight of its own (tied embeddings)")
    column = isinstance(module, ColumnParallelLinear)
    out_local, in_local = module.weight.shape
    shape_a, shape_b = ((cfg.rank, in_local), (out_local, cfg.rank))
    kw = {"device": module.weight.device, "dtype": module.weight.dtype}
    module.lora_A = torch.nn.Linear(shape_a[1], shape_a[0], bias=False, **kw)
    module.lora_B = torch.nn.Linear(shape_b[1], shape_b[0], bias=False, **kw)
    split = module.lora_B.weight if column else module.lora_A.weight
    set_tensor_model_parallel_attributes(split, is_parallel=True, dim=0 if column else 1, stride=1)
    module.lora_scale, module.lora_dropout, module.lora_swiglu = lora_scale(cfg), cfg.dropout, swiglu
    module.__class__ = LoraColumnParallelLinear if column else LoraRowParallelLinear


def apply_lora(model_chunks: list[torch.nn.Module], cfg: LoraConfig, seed: int = 0) -> list[str]:
    """Add adapters to the layers of ``model_chunks`` named by ``cfg.targets``, freeze everything else
    and initialise the adapters (A random, B zero; independent of the layout). Call before DDP wraps
    the chunks. Returns the qualified names of the adapted layers (of every chunk)."""
    check_lora_config(cfg, sequence_parallel=False)
    if cfg.rank == 0:
        return []
    found: list[tuple[str, torch.nn.Module, bool]] = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        parents = {id(m): p for p in model.modules() for m in p.children()}
        for name, module in model.named_modules():
            if not name or name.endswith((".lora_A", ".lora_B")) or isinstance(module, _LoraMixin):
                continue  # adapted already
            if not _matches(name, cfg.targets):
                continue
            if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
                raise LoongError(
                    f"model.lora.targets: {name} is a {type(module).__name__}; LoRA adapts megatron-core's "
                    "ColumnParallelLinear / RowParallelLinear (Transformer Engine layers are not supported)"
                )
            parent = parents.get(id(module))
            swiglu = isinstance(parent, MLP) and name.endswith("linear_fc1") and bool(parent.config.gated_linear_unit)
            found.append((name, module, swiglu))
    if not found:
        layers = sorted({n.rsplit(".", 1)[-1] for c in model_chunks for n, m in unwrap(c).named_modules()
                         if isinstance(m, ColumnParallelLinear | RowParallelLinear)})
        raise LoongError(f"model.lora.targets={list(cfg.targets)} match no layer; candidates: {layers}")
    for name, module, swiglu in found:
        _attach(module, name, cfg, swiglu)
    for chunk in model_chunks:
        for pname, param in unwrap(chunk).named_parameters():
            param.requires_grad_(is_adapter_key(pname))
    init_adapters(model_chunks, seed)
    return [name for name, _, _ in found]


# --- whole (layout-independent) adapter tensors ---------------------------------------------------
def _load_whole(model_chunks: list[torch.nn.Module], full: Mapping[str, torch.Tensor],
                select: Callable[[str], bool]) -> None:
    """Copy whole tensors into this rank's slices of the selected keys (all must be in ``full``)."""
    load_full_state(model_chunks, full, select)


def load_adapter_state(model_chunks: list[torch.nn.Module], full: Mapping[str, torch.Tensor]) -> None:
    """Load whole adapter tensors (keyed by sharded keys) into the model at any layout."""
    _load_whole(model_chunks, full, is_adapter_key)


def load_base_state(model_chunks: list[torch.nn.Module], full: Mapping[str, torch.Tensor]) -> None:
    """``loong.core.engines.megatron.state.load_full_state`` for every tensor but the adapters (e.g. HF weights)."""
    _load_whole(model_chunks, full, lambda key: not is_adapter_key(key))


def adapter_shapes(model_chunks: list[torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """The whole shape of every adapter tensor the chunks hold (this rank's chunks)."""
    return {st.key: tuple(st.global_shape) for st in sharded_tensors(model_chunks) if is_adapter_key(st.key)}


def initial_adapter_state(shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Whole initial adapters: A ~ U(±1/sqrt(in)) from a generator seeded by (seed, key), B = 0."""
    out = {}
    for key, shape in shapes.items():
        if key.endswith(B_SUFFIX):
            out[key] = torch.zeros(shape)
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        bound = 1.0 / math.sqrt(shape[-1])
        out[key] = (torch.rand(shape, generator=g) * 2 - 1) * bound
    return out


def init_adapters(model_chunks: list[torch.nn.Module], seed: int = 0) -> None:
    """(Re)initialise every adapter as :func:`initial_adapter_state` describes."""
    load_adapter_state(model_chunks, initial_adapter_state(adapter_shapes(model_chunks), seed))


def merge_lora(full: Mapping[str, torch.Tensor], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """Whole native tensors with adapters (``gather_full_state`` / ``load_plain_tensors`` output, layers
    stacked on a leading axis) → the same dict without adapter keys, each adapted weight replaced by
    ``W + (alpha/rank)·B@A`` (computed in fp32, returned in W's dtype)."""
    out = {k: v for k, v in full.items() if not is_adapter_key(k)}
    for key_a in (k for k in full if k.endswith(A_SUFFIX)):
        stem = key_a[: -len(A_SUFFIX)]
        key_b, key_w = stem + B_SUFFIX, stem + ".weight"
        if key_b not in full or key_w not in full:
            raise LoongError(f"{key_a}: no matching {key_b if key_b not in full else key_w} to merge into")
        a, b, w = full[key_a].float(), full[key_b].float(), full[key_w]
        if b.shape[-1] != a.shape[-2] or w.shape != (*b.shape[:-1], a.shape[-1]):
            raise LoongError(f"{stem}: adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
                             f"weight {tuple(w.shape)}")
        out[key_w] = (w.float() + lora_scale(cfg) * (b @ a)).to(w.dtype)
    return out
