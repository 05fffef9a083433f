"""Pieces shared by the vision encoders and projectors of loong-vlm.

- :class:`EncoderOutput` / :class:`ProjectorOutput`: what every encoder and projector returns.
- Building blocks, plain ``nn.Module`` with ``nn.Linear`` layers so that a tensor-parallel pass applied from
  outside can shard them (column: ``qkv``, ``fc1``, ``gate_proj``, ``up_proj``; row: ``proj``, ``fc2``,
  ``down_proj``): :class:`VisionAttention` (fused ``qkv`` laid out **per head** ``[heads, 3, head_dim]`` so a
  contiguous shard of its rows holds whole heads; the number of heads is read from the weight), :class:`GatedMLP`,
  :class:`MLP`, :class:`RMSNorm`, :class:`VisionBlock` (pre-norm residual block) and :class:`PatchMerger`
  (Qwen's ``spatial_merge_size**2`` patches → one token).
- Attention of several images packed in one sequence runs through :func:`loong.core.attention.varlen_attention`
  with per-token document ids (one document per image frame, or per window), never a dense mask.
- The Qwen ViTs' 2-D rotary embedding (:func:`rotary_cos_sin`, :func:`apply_rotary`) and patch bookkeeping over
  ``grid_thw`` (:func:`grid_list`, :func:`vision_position_ids`, :func:`frame_doc_ids`).
- :class:`KeyRule` / :func:`map_state`: a declared, strictly checked, invertible key mapping for HF state dicts.
- :class:`VitCost`: forward FLOPs of a ViT as ``quadratic·n² + linear·n`` per attention group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loong.core.attention import varlen_attention
from loong.core.errors import LoongError


@dataclass
class EncoderOutput:
    """What a vision encoder returns.

    ``hidden [n_patches, hidden]``: the final features in the processor's patch order (the merge-unit order the
    projector expects; any internal reordering, e.g. Qwen2.5-VL's windows, is undone). ``intermediates``: the
    hidden states after the blocks a projector taps (Qwen3-VL's DeepStack), in tap order; empty otherwise.
    """

    hidden: torch.Tensor
    intermediates: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ProjectorOutput:
    """What a projector returns: ``embeds [n_tokens, out_hidden]``, one row per image placeholder token in the
    processor's order, and ``deepstack`` (Qwen3-VL), extra ``[n_tokens, out_hidden]`` embeddings added to the
    foundation's hidden states after its first layers, in ``deepstack_visual_indexes`` order; empty otherwise."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- activations

def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


#: HF ``hidden_act`` name -> function (the names transformers' ACT2FN uses)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
}


def activation(name: str, path: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name`` (an HF ``hidden_act``); ``path`` names the config key for the error."""
    if name not in ACTIVATIONS:
        raise LoongError(f"{path}: activation {name!r} is not one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# ------------------------------------------------------------------------------------------------------ layers

class RMSNorm(nn.Module):
    """RMSNorm normalising in fp32 and scaling in the input dtype (the Qwen ViTs' norm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``rms`` (:class:`RMSNorm`) or ``layer`` (``nn.LayerNorm``) of width ``dim``."""
    if kind == "rms":
        return RMSNorm(dim, eps)
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps)
    raise LoongError(f"norm kind {kind!r} is not 'rms' or 'layer'")


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``; gate and up stay separate layers so that each shards by
    columns on its own."""

    def __init__(self, dim: int, inner: int, act: Callable[[torch.Tensor], torch.Tensor], bias: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=bias)
        self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj = nn.Linear(inner, dim, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MLP(nn.Module):
    """``fc2(act(fc1(x)))``."""

    def __init__(self, dim: int, inner: int, act: Callable[[torch.Tensor], torch.Tensor], bias: bool = True,
                 out_dim: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, inner, bias=bias)
        self.fc2 = nn.Linear(inner, out_dim or dim, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


# ---------------------------------------------------------------------------------------------- 2-D rotary

def rotary_cos_sin(pos_hw: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [n, head_dim]`` (fp32) of the Qwen ViTs' axial 2-D RoPE at positions ``pos_hw [n, 2]`` (row, col).

    A quarter of the head's frequencies (``theta ** (-4i/head_dim)``) rotate by the row, the same frequencies by
    the column: angles ``[row·f, col·f]`` fill half the head and repeat for the other half (rotate-half layout).
    Computed per call, not held in a buffer, so a module built on ``meta`` needs no buffer re-initialisation.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=pos_hw.device) / half))
    angles = (pos_hw[..., None].float() * inv_freq).flatten(1)   # [n, 2, hd/4] -> [n, hd/2]: rows then cols
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [n, heads, head_dim]`` by ``cos, sin [n, head_dim]`` in fp32 (rotate-half), back in x's dtype."""
    h = x.float()
    h1, h2 = h.chunk(2, dim=-1)
    rotated = torch.cat([-h2, h1], dim=-1)
    return (h * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


# ------------------------------------------------------------------------------------------------- attention

class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention over packed images, documents given by per-token ids.

    ``qkv`` is one ``nn.Linear(dim, 3 * dim)`` whose output rows are ordered ``[heads, 3 (q, k, v), head_dim]``
    (megatron's per-head interleave, not HF's ``[3, heads, head_dim]``; the family mappings permute), so a
    tensor-parallel column shard of it holds whole heads; the forward reads the local number of heads from the
    width of ``qkv``'s output. ``proj`` is the output projection (row-parallel).
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, proj_bias: bool = True) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, impl: str | None = None) -> torch.Tensor:
        """``x [n, dim]``, ``doc_ids [n]`` (tokens attend to tokens of the same id), ``rope`` the ``(cos, sin)``
        of :func:`rotary_cos_sin` or None, ``impl`` the varlen implementation (None: the reference)."""
        n = x.shape[0]
        qkv = self.qkv(x)
        # the local head count from the output's width: right under any column sharding of qkv
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(n, heads, 3, self.head_dim).unbind(2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        # [n, heads, hd] -> SDPA layout [1, heads, n, hd]: the packed images are one batch row
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        out = varlen_attention(q, k, v, doc_ids[None], impl=impl)
        return self.proj(out[0].transpose(0, 1).reshape(n, heads * self.head_dim))


class VisionBlock(nn.Module):
    """Pre-norm residual block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, norm1: nn.Module, attn: VisionAttention, norm2: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm1
        self.attn = attn
        self.norm2 = norm2
        self.mlp = mlp

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, impl: str | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), doc_ids, rope, impl)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Qwen's patch merger: ``merge = spatial_merge_size**2`` consecutive patches (one merge unit, in the
    processor's order) are normalised, concatenated and mapped by ``fc2(act(fc1(·)))`` to ``out_dim``.

    ``postshuffle_norm=False`` normalises each patch (width ``dim``) before the concatenation, ``True`` the
    concatenated ``dim * merge`` vector (Qwen3-VL's DeepStack mergers).
    """

    def __init__(self, dim: int, merge: int, inner: int, out_dim: int, *, norm: str, eps: float,
                 act: Callable[[torch.Tensor], torch.Tensor], postshuffle_norm: bool = False) -> None:
        super().__init__()
        self.merge = merge
        self.in_dim = dim * merge
        self.postshuffle_norm = postshuffle_norm
        self.norm = make_norm(norm, self.in_dim if postshuffle_norm else dim, eps)
        self.fc1 = nn.Linear(self.in_dim, inner)
        self.fc2 = nn.Linear(inner, out_dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n_patches, dim]`` -> ``[n_patches / merge, out_dim]``."""
        if x.shape[0] % self.merge:
            raise LoongError(f"patch merger: {x.shape[0]} patches do not form whole merge units of {self.merge}")
        x = self.norm(x.reshape(-1, self.in_dim)) if self.postshuffle_norm else self.norm(x).reshape(-1, self.in_dim)
        return self.fc2(self.act(self.fc1(x)))


# ------------------------------------------------------------------------------------- patches and documents

def grid_list(grid_thw: torch.Tensor | Iterable, merge: int, path: str = "grid_thw") -> list[tuple[int, int, int]]:
    """``grid_thw [n_images, 3]`` (frames, patch rows, patch columns per image or video) as int triples, checked:
    every entry >= 1 and rows/columns divisible by ``merge`` (the spatial merge size). The grids are host
    metadata: the training task keeps them on the CPU (a device ``grid_thw`` works too, at the cost of a
    device-to-host sync here)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(r) for r in grid_thw]
    out = []
    for i, row in enumerate(rows):
        if len(row) != 3:
            raise LoongError(f"{path}[{i}]: must be (t, h, w), got {row}")
        t, h, w = (int(v) for v in row)
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise LoongError(f"{path}[{i}] = {(t, h, w)}: t, h, w must be >= 1 and h, w multiples of the spatial "
                             f"merge size {merge}")
        out.append((t, h, w))
    if not out:
        raise LoongError(f"{path}: no images")
    return out


def check_pixel_values(pixel_values: torch.Tensor, grid: list[tuple[int, int, int]], patch_dim: int) -> None:
    """``pixel_values`` must be ``[sum(t*h*w), patch_dim]`` (the Qwen processors' flattened patches)."""
    n = sum(t * h * w for t, h, w in grid)
    if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (n, patch_dim):
        raise LoongError(f"pixel_values: expected [{n}, {patch_dim}] (sum of t*h*w over grid_thw, "
                         f"channels*temporal_patch_size*patch_size**2), got {list(pixel_values.shape)}")


def vision_position_ids(grid: list[tuple[int, int, int]], merge: int, device: torch.device) -> torch.Tensor:
    """``[n_patches, 2]`` (row, column) of every patch in the processor's order: merge units of ``merge × merge``
    patches row-major over the image, patches row-major inside a unit, frames one after the other."""
    parts = []
    for t, h, w in grid:
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        pos = torch.stack([rows, cols], dim=-1)  # [h, w, 2]
        pos = pos.reshape(h // merge, merge, w // merge, merge, 2).transpose(1, 2).reshape(h * w, 2)
        parts.append(pos.repeat(t, 1))
    return torch.cat(parts)


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t``, a small tensor built on the host (index tensors from the grids), on ``device`` without stalling the
    host: a plain ``.to(device)`` of pageable memory (or ``torch.tensor(..., device=...)``) waits for the stream
    to drain, so the copy goes through pinned memory, asynchronously (CUDA's pinned allocator; other devices get a
    plain copy). A CPU ``device`` returns ``t``."""
    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def frame_doc_ids(grid: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """``[n_patches]`` document id of every patch: each frame of each image/video is its own document (the Qwen
    ViTs attend within a frame, never across frames or images). Built on the host from the grid (no device
    sync), then copied."""
    sizes = [h * w for t, h, w in grid for _ in range(t)]
    return host_to_device(torch.from_numpy(np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)), device)


# -------------------------------------------------------------------------------------------------- mappings

def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class KeyRule:
    """One HF tensor ↔ one native tensor; ``to_native`` / ``to_hf`` are exact inverses (reshapes/permutations)."""

    hf: str
    native: str
    to_native: Callable[[torch.Tensor], torch.Tensor] = _identity
    to_hf: Callable[[torch.Tensor], torch.Tensor] = _identity


def map_state(state: Mapping[str, torch.Tensor], rules: list[KeyRule], *, to_native: bool,
              where: str) -> dict[str, torch.Tensor]:
    """Apply ``rules`` to ``state`` (HF keys when ``to_native``, else native keys). The keys must be exactly the
    rules' keys: a missing or an unexpected key is a :class:`LoongError` naming it (``where`` says which mapping)."""
    src = {r.hf if to_native else r.native: r for r in rules}
    missing = sorted(set(src) - set(state))
    unexpected = sorted(set(state) - set(src))
    if missing or unexpected:
        raise LoongError(f"{where}: state dict does not match the config: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    out = {}
    for key, rule in src.items():
        if to_native:
            out[rule.native] = rule.to_native(state[key])
        else:
            out[rule.hf] = rule.to_hf(state[key])
    return out


def qkv_hf_to_native(heads: int) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                          Callable[[torch.Tensor], torch.Tensor]]:
    """``(to_native, to_hf)`` for a fused qkv weight/bias: HF rows ``[3, heads, hd]`` ↔ native ``[heads, 3, hd]``."""

    def to_native(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()

    def to_hf(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()

    return to_native, to_hf


def conv_to_linear(shape: tuple[int, ...]) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                    Callable[[torch.Tensor], torch.Tensor]]:
    """``(to_native, to_hf)`` for a patch-embedding Conv weight of ``shape`` (``[d, C, (T,) P, P]``, stride =
    kernel) ↔ a Linear ``[d, C*(T*)P*P]`` on the flattened patch: the same numbers, reshaped."""

    def to_native(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1).contiguous()

    def to_hf(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(shape).contiguous()

    return to_native, to_hf


_REQUIRED = object()


def hf_value(hf: Mapping, *names: str, default: object = _REQUIRED, where: str = "vision_config") -> object:
    """The first of ``names`` (a field and its aliases, e.g. ``in_channels``/``in_chans``) present in the HF config
    dict ``hf``; ``default`` when none is, or a :class:`LoongError` naming ``where.<name>`` when required."""
    for name in names:
        if name in hf and hf[name] is not None:
            return hf[name]
    if default is _REQUIRED:
        raise LoongError(f"{where}.{names[0]}: missing from the Hugging Face config")
    return default


# ----------------------------------------------------------------------------------------------------- init

def init_vision_weights(module: nn.Module, std: float) -> None:
    """HF-style initialisation: Linear and Embedding weights ~ N(0, std), biases 0, norm weights 1 (biases 0)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, (RMSNorm, nn.LayerNorm)):
            if m.weight is not None:
                nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


# ----------------------------------------------------------------------------------------------------- FLOPs

@dataclass(frozen=True)
class VitCost:
    """Forward FLOPs (2 per multiply-add) of a ViT over **one attention group** of ``n`` patches (a Qwen image,
    or one frame of a video): ``quadratic·n² + linear·n``. ``quadratic`` is full attention's scores and weighted
    sum (``4·hidden`` per query–key pair and full-attention block); ``linear`` is every per-patch layer
    (patch embedding, qkv/proj, MLP, projector per patch) plus windowed attention at its full window size.
    Training costs ≈ 3× the forward. This is the ``enc_a·n² + enc_b·n`` of
    :class:`loong.core.balance.cost.CostModel` for the encoder part, up to a constant factor."""

    quadratic: float
    linear: float

    def __call__(self, n: float) -> float:
        return self.quadratic * n * n + self.linear * n


def attention_pair_flops(hidden: int) -> int:
    """FLOPs per query–key pair of one attention layer: ``q·k`` and ``p·v``, ``2·hidden`` each."""
    return 4 * hidden


def sqrt_int(n: int, path: str) -> int:
    """The integer square root of ``n``; a :class:`LoongError` naming ``path`` if ``n`` is not a square."""
    side = math.isqrt(n)
    if side * side != n:
        raise LoongError(f"{path}: {n} is not a square number (a square grid of learned positions)")
    return side


__all__ = ["ACTIVATIONS", "EncoderOutput", "GatedMLP", "KeyRule", "MLP", "PatchMerger", "ProjectorOutput",
           "RMSNorm", "VisionAttention", "VisionBlock", "VitCost", "activation", "apply_rotary",
           "attention_pair_flops", "check_pixel_values", "conv_to_linear", "frame_doc_ids", "grid_list", "hf_value",
           "init_vision_weights", "make_norm", "map_state", "qkv_hf_to_native", "rotary_cos_sin", "sqrt_int",
           "vision_position_ids"]
