"""loong-kernels' fused ops in a Hugging Face LLaMA causal LM, by module replacement.

A ``transformers`` ``LlamaForCausalLM`` trained as it is (the fsdp engine takes any ``nn.Module``) gets the fused
kernels the megatron models get (:mod:`loong.llm.models.fused`) by swapping modules, never by patching functions:
:func:`fuse_llama` replaces

- each ``LlamaRMSNorm`` by :class:`FusedLlamaRMSNorm` (``loong.kernels.rms_norm``);
- each ``LlamaMLP`` by :class:`FusedSwiGLUMLP`: the gate and up projections as one GEMM, then
  ``loong.kernels.swiglu``;
- each ``LlamaAttention`` by :class:`FusedRoPELlamaAttention`, its subclass that rotates q and k with
  ``loong.kernels.apply_rope`` (from HF's own cos/sin tables, so every HF RoPE variant is kept);
- the ``lm_head`` by :class:`FusedLMHead`, which in :func:`fused_lm_loss` gives the mean cross-entropy through
  ``loong.kernels.fused_linear_cross_entropy`` without the ``[tokens, vocab]`` logits and their fp32 copy.

The new modules hold the replaced modules' own ``Parameter`` objects (or their very ``nn.Linear`` children), so
parameter names (``model.layers.0.mlp.gate_proj.weight`` ...), values, the tied embedding and checkpoints stay
HF's, and HF's classes and functions stay untouched for every other model in the process.

Numerics: in fp32 the fused model gives the stock one's logits and gradients (``tests/test_hf_fused.py``). In
bf16 the kernels round less: RMSNorm multiplies by the weight in fp32 before its one rounding (HF rounds the
normalised input first), RoPE rotates in fp32 (HF in the input dtype), the loss never rounds the logits to bf16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    eager_attention_forward,
)

from loong.core.errors import LoongError
from loong.kernels import apply_rope, fused_linear_cross_entropy, rms_norm, swiglu
from loong.llm.models.fused import FusedKernels, fused_backend


def resolve_hf_fused_kernels(mode: str, capabilities: set[str]) -> FusedKernels:
    """The plan for ``model.fused_kernels=mode`` on an HF LLaMA, on an accelerator with ``capabilities``.

    ``off``: none. ``auto``: all four ops where the accelerator reports ``triton`` (kernels called with
    ``backend="auto"``), none elsewhere. ``on``: all four, ``backend="triton"`` (an input a kernel cannot take fails
    instead of falling back); a :class:`LoongError` where ``triton`` is not reported. Transformer Engine and tensor
    parallelism, which limit the megatron plan, play no part: the HF model uses neither.
    """
    backend = fused_backend(mode, capabilities)
    return FusedKernels() if backend is None else FusedKernels.everything(backend)


class FusedLlamaRMSNorm(nn.Module):
    """``LlamaRMSNorm`` through ``loong.kernels.rms_norm``, holding the replaced norm's ``weight`` Parameter."""

    def __init__(self, norm: LlamaRMSNorm, backend: str = "auto") -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self.backend = backend

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, backend={self.backend}"


class FusedSwiGLUMLP(nn.Module):
    """``LlamaMLP`` (SiLU) as ``down_proj(swiglu(x @ [gate; up].T))`` with the replaced MLP's own projections.

    The kernel takes ``[..., 2 * ffn]`` with the gate first. Concatenating the two weights (``2 * ffn x hidden``)
    costs far less traffic than concatenating the two outputs (``tokens x 2 * ffn``) and makes one GEMM of two;
    autograd splits the gradient back into ``gate_proj.weight`` and ``up_proj.weight``.
    """

    def __init__(self, mlp: LlamaMLP, backend: str = "auto") -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj, self.up_proj
        bias = None if gate.bias is None else torch.cat((gate.bias, up.bias))
        gate_up = F.linear(x, torch.cat((gate.weight, up.weight)), bias)
        return self.down_proj(swiglu(gate_up, backend=self.backend))


def _half_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's full-width ``[b or 1, s, 2r]`` tables (``cat(freqs, freqs)``, attention scaling applied) as the kernel's
    half-width ``[s, r]`` (positions shared by the batch) or ``[s, b, r]``."""
    r = cos.shape[-1] // 2
    if cos.shape[0] == 1:
        return cos[0, :, :r], sin[0, :, :r]
    return cos[..., :r].transpose(0, 1), sin[..., :r].transpose(0, 1)


class FusedRoPELlamaAttention(LlamaAttention):
    """``LlamaAttention`` whose q/k rotation is ``loong.kernels.apply_rope``; the projections are the replaced
    module's own ``nn.Linear`` children. The forward follows transformers' ``LlamaAttention.forward`` (5.x) but for
    the rotation, done in the projections' ``[b, s, heads, head_dim]`` layout before the transpose to SDPA's."""

    backend: str = "auto"

    @classmethod
    def replacing(cls, attn: LlamaAttention, backend: str = "auto") -> FusedRoPELlamaAttention:
        """The fused module holding ``attn``'s projections (built on the meta device: no weights are drawn)."""
        with torch.device("meta"):
            new = cls(attn.config, attn.layer_idx)
        for name, child in attn.named_children():
            new.register_module(name, child)
        new.backend = backend
        return new.train(attn.training)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None, past_key_values: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else past_key_values  # the cache's name before transformers renamed it
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = _half_tables(*position_embeddings)
        query, key = apply_rope(query, key, cos, sin, layout="bshd", backend=self.backend)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, query, key, value, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class FusedLMHead(nn.Module):
    """The output projection, holding the replaced ``lm_head``'s ``weight`` Parameter (tied or not).

    Called plainly it gives the logits, as ``nn.Linear`` does. Inside :func:`fused_lm_loss` (``labels`` set) it gives
    the mean cross-entropy against them instead: ``loong.kernels.fused_linear_cross_entropy``, which walks the tokens
    in chunks and finishes the gradients during the forward, so no ``[tokens, vocab]`` tensor outlives a chunk. The
    loss has to come out of the model's own forward (HF's ``forward`` returns what ``lm_head`` returns as
    ``.logits``): a wrapper such as FSDP2 unshards and reduces the head's parameters around that forward only.
    """

    def __init__(self, head: nn.Linear, backend: str = "auto") -> None:
        super().__init__()
        if head.bias is not None:
            raise ValueError("FusedLMHead replaces an output projection without bias")
        self.weight = head.weight
        self.in_features, self.out_features = head.in_features, head.out_features
        self.backend = backend
        self.labels: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return F.linear(hidden_states, self.weight)
        return fused_linear_cross_entropy(hidden_states, self.weight, self.labels, reduction="mean",
                                          backend=self.backend)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"


def _unwrapped(model: nn.Module) -> nn.Module:
    """The HF model inside a ``DistributedDataParallel`` wrapper (FSDP2 wraps in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def fused_head(model: nn.Module) -> FusedLMHead | None:
    """The model's :class:`FusedLMHead`, or None when its output projection is HF's own."""
    head = _unwrapped(model).get_output_embeddings()
    return head if isinstance(head, FusedLMHead) else None


@contextlib.contextmanager
def _labels_on(head: FusedLMHead, labels: torch.Tensor) -> Iterator[None]:
    head.labels = labels
    try:
        yield
    finally:
        head.labels = None


def fused_lm_loss(model: nn.Module, labels: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """``model(**inputs)``'s mean next-token cross-entropy against ``labels`` (``[b, s]``, already shifted; ``-100``
    ignored), computed by the model's :class:`FusedLMHead` without logits: the same loss as
    ``F.cross_entropy(model(**inputs).logits.float().flatten(0, 1), labels.flatten())``."""
    head = fused_head(model)
    if head is None:
        raise LoongError("fused_lm_loss: the model's lm_head is not a FusedLMHead (fuse_llama with cross_entropy)")
    with _labels_on(head, labels):
        return model(**inputs).logits


def fuse_llama(model: nn.Module, plan: FusedKernels) -> dict[str, int]:
    """Swap ``plan``'s fused modules into a ``transformers`` LLaMA model in place; returns how many modules of each
    kind (``norm``, ``swiglu``, ``rope``, ``cross_entropy``) were replaced.

    Only exact LLaMA classes are taken (a subclass may compute something else): ``LlamaRMSNorm``, ``LlamaMLP`` with
    ``hidden_act="silu"``, ``LlamaAttention``, and an output projection without bias. Call it on the plain model,
    before it is wrapped, sharded or compiled.
    """
    counts = dict.fromkeys(("norm", "swiglu", "rope", "cross_entropy"), 0)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind: str | None = None
            if plan.norm and type(child) is LlamaRMSNorm:
                kind, new = "norm", FusedLlamaRMSNorm(child, plan.backend)
            elif plan.swiglu and type(child) is LlamaMLP and child.config.hidden_act == "silu":
                kind, new = "swiglu", FusedSwiGLUMLP(child, plan.backend)
            elif plan.rope and type(child) is LlamaAttention:
                kind, new = "rope", FusedRoPELlamaAttention.replacing(child, plan.backend)
            if kind is not None:
                parent.register_module(name, new)
                counts[kind] += 1
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if plan.cross_entropy and type(head) is nn.Linear and head.bias is None:
        model.set_output_embeddings(FusedLMHead(head, plan.backend))
        counts["cross_entropy"] = 1
    return counts
