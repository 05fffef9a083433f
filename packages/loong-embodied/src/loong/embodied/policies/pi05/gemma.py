"""Gemma decoder pieces for Pi0.5, and the joint layer in which PaliGemma and the action expert attend together.

Facts from openpi's ``gemma_pytorch.py`` / lerobot's ``pi_gemma.py`` (written anew here): Gemma's RMSNorm scales by
``1 + w`` and computes in fp32; the expert's norms are *adaptive* (adaRMSNorm): a linear map of the timestep
embedding gives a scale, a shift and a gate, and the gate multiplies the residual branch; the MLP is GeGLU
(tanh-approximated GELU); attention is grouped-query with RoPE (``rotate_half`` layout, base 10000). Parameter
names follow transformers' Gemma (``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ...) so the
lerobot mapping is a prefix rename.

The VLM's norms are loong-kernels' fused RMSNorm (``offset=1`` is Gemma's ``1 + w``). The expert's adaptive norm
keeps the normalised activations in fp32 through the modulation (as openpi), which that kernel's output (cast to
the input dtype) does not, so it is plain PyTorch; so is RoPE (the table is cast to the activations' dtype before
the rotation, as transformers does, where loong-kernels rotates in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loong.kernels import rms_norm


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, in fp32, cast back to the input's dtype: loong-kernels'
    ``rms_norm`` with ``offset=1`` (the same arithmetic; its Triton kernel on CUDA tensors, its plain-PyTorch
    reference elsewhere)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return rms_norm(x, self.weight, self.eps, offset=1.0, backend="auto"), None


class AdaRMSNorm(nn.Module):
    """adaRMSNorm: RMSNorm whose scale, shift and residual gate come from the condition (the timestep embedding).

    ``dense`` maps ``cond [b, cond_dim]`` to ``[scale, shift, gate]``, each ``[b, dim]``; zero-initialised weights
    (as openpi) make it start as a plain RMSNorm with a gate of ``bias``."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if cond is None:
            raise ValueError("AdaRMSNorm needs its condition (the timestep embedding)")
        var = x.float().square().mean(-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        modulation = self.dense(cond)
        if x.dim() == 3:
            modulation = modulation.unsqueeze(1)
        scale, shift, gate = modulation.chunk(3, dim=-1)
        out = normed * (1 + scale.float()) + shift.float()
        return out.to(x.dtype), gate.to(x.dtype)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``x + y`` (plain norm) or ``x + y * gate`` (adaRMSNorm)."""
    return x + y if gate is None else x + y * gate


class GeGLU(nn.Module):
    """Gemma's MLP: ``down(gelu_tanh(gate(x)) * up(x))``, no biases."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttentionProjections(nn.Module):
    """The q/k/v/o projections of one Gemma attention (the attention itself runs jointly, in :class:`JointLayer`)."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(width, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, width, bias=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[b, heads, s, head_dim]`` queries, keys and values of ``x [b, s, width]``."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        return q, k, v


class GemmaLayer(nn.Module):
    """One Gemma decoder layer's parameters: norms, attention projections, MLP (plain or adaptive norms)."""

    def __init__(self, width: int, mlp_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 cond_dim: int | None = None) -> None:
        super().__init__()
        self.self_attn = GemmaAttentionProjections(width, num_heads, num_kv_heads, head_dim)
        self.mlp = GeGLU(width, mlp_dim)
        if cond_dim is None:
            self.input_layernorm: nn.Module = GemmaRMSNorm(width, eps)
            self.post_attention_layernorm: nn.Module = GemmaRMSNorm(width, eps)
        else:
            self.input_layernorm = AdaRMSNorm(width, cond_dim, eps)
            self.post_attention_layernorm = AdaRMSNorm(width, cond_dim, eps)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None,
               cond: torch.Tensor | None) -> torch.Tensor:
        """The rest of the layer after attention: output projection, residual, norm, MLP, residual."""
        h = gated_residual(x, self.self_attn.o_proj(attn), gate)
        normed, gate2 = self.post_attention_layernorm(h, cond)
        return gated_residual(h, self.mlp(normed), gate2)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``cos, sin`` ``[b, s, head_dim]`` for integer ``position_ids [b, s]`` (the frequencies repeat over the
    two halves, as transformers' Gemma)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=position_ids.device) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, head_dim]`` by the positions' angles (``rotate_half`` convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention of ``q [b, h, s, d]`` over ``k, v [b, kv, t, d]`` where ``mask [b, s, t]`` (bool)
    allows; returns ``[b, s, h * d]``. Every row of ``mask`` must allow at least one key."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2).flatten(2)


class JointLayer(nn.Module):
    """Layer ``i`` of both Gemmas: the VLM layer (``vlm``) on the prefix and the expert layer (``expert``) on the
    suffix, attending over the concatenation of both sequences (one FSDP / recompute unit).

    :meth:`forward` runs both streams (training); :meth:`prefix` the VLM alone, returning its keys/values for the
    cache; :meth:`suffix` the expert alone over cached prefix keys/values (inference). In the ``last`` layer the
    prefix's own output is never read (only the actions are decoded), so there the VLM half only makes keys and
    values: its query and output projections, post-attention norm and MLP are dead (:meth:`dead_parameters`)."""

    def __init__(self, vlm: GemmaLayer, expert: GemmaLayer, rope_theta: float, *, last: bool = False) -> None:
        super().__init__()
        self.vlm = vlm
        self.expert = expert
        self.rope_theta = rope_theta
        self.last = last

    def dead_parameters(self) -> list[nn.Parameter]:
        """Parameters no output depends on (the last layer's prefix path; none elsewhere)."""
        if not self.last:
            return []
        attn = self.vlm.self_attn
        return [*attn.q_proj.parameters(), *attn.o_proj.parameters(),
                *self.vlm.post_attention_layernorm.parameters(), *self.vlm.mlp.parameters()]

    def _rope(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(position_ids, q.shape[-1], self.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def _vlm_kv(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VLM's rotated keys and values alone (the last layer's prefix)."""
        b, s, _ = x.shape
        attn = self.vlm.self_attn
        k = attn.k_proj(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, attn.head_dim, self.rope_theta, k.dtype)
        return apply_rope(k, cos, sin), v

    def forward(self, prefix: torch.Tensor, suffix: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
                cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both streams one layer on: ``prefix [b, p, vlm_width]``, ``suffix [b, s, expert_width]``, ``mask
        [b, p + s, p + s]``, ``position_ids [b, p + s]``, ``cond [b, expert_width]``. The last layer returns its
        ``prefix`` input unchanged (its prefix output is dead)."""
        p = prefix.shape[1]
        x_p, gate_p = self.vlm.input_layernorm(prefix, None)
        x_s, gate_s = self.expert.input_layernorm(suffix, cond)
        if self.last:
            k_p, v_p = self._vlm_kv(x_p, position_ids[:, :p])
            q_s, k_s, v_s = self.expert.self_attn.qkv(x_s)
            q_s, k_s = self._rope(q_s, k_s, position_ids[:, p:])
            out = attention(q_s, torch.cat([k_p, k_s], dim=2), torch.cat([v_p, v_s], dim=2), mask[:, p:])
            return prefix, self.expert.finish(suffix, out, gate_s, cond)
        q_p, k_p, v_p = self.vlm.self_attn.qkv(x_p)
        q_s, k_s, v_s = self.expert.self_attn.qkv(x_s)
        q, k = self._rope(torch.cat([q_p, q_s], dim=2), torch.cat([k_p, k_s], dim=2), position_ids)
        out = attention(q, k, torch.cat([v_p, v_s], dim=2), mask)
        return (self.vlm.finish(prefix, out[:, :p], gate_p, None),
                self.expert.finish(suffix, out[:, p:], gate_s, cond))

    def prefix(self, prefix: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The VLM stream alone; returns the next hidden states (the input, in the last layer) and this layer's
        (rotated) keys and values."""
        x, gate = self.vlm.input_layernorm(prefix, None)
        if self.last:
            k, v = self._vlm_kv(x, position_ids)
            return prefix, k, v
        q, k, v = self.vlm.self_attn.qkv(x)
        q, k = self._rope(q, k, position_ids)
        out = attention(q, k, v, mask)
        return self.vlm.finish(prefix, out, gate, None), k, v

    def suffix(self, suffix: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, mask: torch.Tensor,
               position_ids: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The expert stream alone over the cached prefix keys/values: ``mask [b, s, p + s]``,
        ``position_ids [b, s]``."""
        x, gate = self.expert.input_layernorm(suffix, cond)
        q, k, v = self.expert.self_attn.qkv(x)
        q, k = self._rope(q, k, position_ids)
        out = attention(q, torch.cat([cache_k, k], dim=2), torch.cat([cache_v, v], dim=2), mask)
        return self.expert.finish(suffix, out, gate, cond)


__all__ = ["AdaRMSNorm", "GeGLU", "GemmaAttentionProjections", "GemmaLayer", "GemmaRMSNorm", "JointLayer",
           "apply_rope", "attention", "gated_residual", "rope_cos_sin"]
