"""Two toy tasks for the fsdp engine: a LLaMA-like decoder and a DiT-like denoiser, each a small file's worth.

This is the example a modality author can copy: a task for the fsdp engine is a config dataclass, a plain
``nn.Module``, and an :class:`~loong.core.engines.fsdp.task.FSDPTask` with ``build_model``, ``loss`` and the
data methods. The data is synthetic and a pure function of (seed, sample index), so every layout reads the same
samples and a resumed run continues exactly.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loong.core.attention import CPGroups, cp_attention, shard_sequence
from loong.core.config.schema import RunConfig
from loong.core.data import rank_microbatches
from loong.core.engines.fsdp.task import FSDPTask
from loong.core.registry import TASKS


@dataclass
class ToyModelConfig:
    """Both toys' shapes. ``freeze``: parameter-name prefixes trained by nobody (a frozen backbone)."""

    preset: str = "toy"
    dim: int = 32
    heads: int = 4
    layers: int = 2
    vocab_size: int = 64
    in_channels: int = 8  # DiT: latent channels per token
    text_len: int = 6  # DiT: text tokens (replicated context for cross-attention)
    recompute: str = "none"
    freeze: list[str] = field(default_factory=list)


@dataclass
class ToyRunConfig(RunConfig):
    """A run of a toy task on the fsdp engine."""

    task: str = "toy.llama"
    engine: str = "fsdp"
    model: ToyModelConfig = field(default_factory=ToyModelConfig)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    """Multi-head attention; ``context`` given: cross-attention to it. Under context parallelism ``x`` is this
    rank's sequence shard and ``cp_attention`` attends over the whole sequence (the context is replicated)."""

    def __init__(self, dim: int, heads: int, causal: bool, cp: CPGroups) -> None:
        super().__init__()
        self.heads, self.causal, self.cp = heads, causal, cp
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        kv = x if context is None else context
        q, k, v = (t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)
                   for t in (self.q(x), self.k(kv), self.v(kv)))
        if self.cp.size > 1:
            out = cp_attention(q, k, v, self.cp, causal=self.causal and context is None,
                               kv_replicated=context is not None)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal and context is None)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, cp: CPGroups) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads, causal=True, cp=cp)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ToyLlama(nn.Module):
    def __init__(self, m: ToyModelConfig, cp: CPGroups) -> None:
        super().__init__()
        self.embed = nn.Embedding(m.vocab_size, m.dim)
        self.layers = nn.ModuleList(LlamaBlock(m.dim, m.heads, cp) for _ in range(m.layers))
        self.norm, self.output = RMSNorm(m.dim), nn.Linear(m.dim, m.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


class DiTBlock(nn.Module):
    """adaLN-modulated self-attention, cross-attention to the text, MLP (Wan's block, in miniature)."""

    def __init__(self, dim: int, heads: int, cp: CPGroups) -> None:
        super().__init__()
        self.modulation = nn.Linear(dim, 6 * dim)
        self.norm1, self.self_attn = nn.LayerNorm(dim, elementwise_affine=False), Attention(dim, heads, False, cp)
        self.norm2, self.cross_attn = nn.LayerNorm(dim), Attention(dim, heads, False, cp)
        self.norm3, self.mlp = nn.LayerNorm(dim, elementwise_affine=False), MLP(dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(temb).unsqueeze(1).chunk(6, dim=-1)
        x = x + gate1 * self.self_attn(self.norm1(x) * (1 + scale1) + shift1)
        x = x + self.cross_attn(self.norm2(x), context)
        return x + gate2 * self.mlp(self.norm3(x) * (1 + scale2) + shift2)


class ToyDiT(nn.Module):
    def __init__(self, m: ToyModelConfig, cp: CPGroups) -> None:
        super().__init__()
        self.dim = m.dim
        self.patch = nn.Linear(m.in_channels, m.dim)
        self.time = nn.Sequential(nn.Linear(m.dim, m.dim), nn.SiLU(), nn.Linear(m.dim, m.dim))
        self.text = nn.Linear(m.dim, m.dim)
        self.blocks = nn.ModuleList(DiTBlock(m.dim, m.heads, cp) for _ in range(m.layers))
        self.head = nn.Linear(m.dim, m.in_channels)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=latents.device) / half)
        angles = timestep[:, None].float() * freqs[None]
        # the sinusoid in fp32, then in the weights' dtype (bf16 under FSDP2's mixed precision), as diffusers' Wan does
        temb = self.time(torch.cat([angles.cos(), angles.sin()], dim=-1).to(self.time[0].weight.dtype))
        x, context = self.patch(latents), self.text(text)
        for block in self.blocks:
            x = block(x, temb, context)
        return self.head(x)


class _ToyTask(FSDPTask):
    """Shared data plumbing: sample ``i`` of the stream is a pure function of (seed, i). The ranks of one
    context-parallel group read the same samples and each takes its shard of the sequence (``shard_sequence``)."""

    def setup_data(self) -> None:
        t = self.cfg.train
        self.gbs, self.mbs, self.seq = t.global_batch_size, t.micro_batch_size, t.seq_length

    @abstractmethod
    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """Sample ``index`` of the stream (a pure function of the seed and the index)."""

    def _batches(self, offset: int, step: int, num_microbatches: int) -> Iterator[dict]:
        return rank_microbatches(self.sample, offset + step * self.gbs, self.gbs, self.layout.dp, self.layout.dp_rank,
                                 num_microbatches)

    def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict]:
        return self._batches(0, step, num_microbatches)

    def eval_microbatches(self, index: int, num_microbatches: int) -> Iterator[dict]:
        return self._batches(10**7, index, num_microbatches)  # a held-out part of the stream

    def tokens_per_step(self) -> int:
        return self.gbs * self.seq

    @classmethod
    def cuda_graph_unsupported(cls, cfg: Any) -> str | None:
        return None  # the toy steps are plain tensor code of fixed shapes

    def build_model(self) -> nn.Module:
        model = self.model_class(self.cfg.model, self.layout.cp_groups)
        for name, p in model.named_parameters():
            if any(name.startswith(prefix) for prefix in self.cfg.model.freeze):
                p.requires_grad_(False)
        return model


@TASKS.register("toy.llama")
class ToyLlamaTask(_ToyTask):
    """Next-token prediction on arithmetic sequences modulo the vocabulary (learnable, so the loss falls)."""

    model_class = ToyLlama

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.cfg.model.vocab_size, (2,), generator=g)
        tokens = (start + stride * torch.arange(self.seq + 1)) % self.cfg.model.vocab_size
        return {"tokens": tokens}

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        cp = self.layout.cp_groups
        inputs, labels = shard_sequence(batch["tokens"][:, :-1], cp), shard_sequence(batch["tokens"][:, 1:], cp)
        logits = model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()), {}


@TASKS.register("toy.dit")
class ToyDiTTask(_ToyTask):
    """Flow matching as Wan trains: x_t = (1 - σ)·x0 + σ·ε, target ε - x0, timestep 1000·σ."""

    model_class = ToyDiT

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        m = self.cfg.model
        g = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + index)
        x0 = torch.randn(self.seq, m.in_channels, generator=g).cumsum(0) / math.sqrt(self.seq)
        noise = torch.randn(self.seq, m.in_channels, generator=g)
        sigma = torch.rand((), generator=g)
        return {"noisy": (1 - sigma) * x0 + sigma * noise, "target": noise - x0, "timestep": 1000 * sigma,
                "text": torch.randn(m.text_len, m.dim, generator=g)}

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        cp = self.layout.cp_groups
        pred = model(shard_sequence(batch["noisy"], cp), batch["timestep"], batch["text"])
        return F.mse_loss(pred.float(), shard_sequence(batch["target"], cp).float()), {}


def toy_config(**sections: Any) -> ToyRunConfig:
    """A validated toy run config from nested dicts (``train={"steps": 3}``, ``model={...}``)."""
    from loong.core.config import from_dict

    base: dict[str, Any] = {"train": {"steps": 10, "seq_length": 16, "global_batch_size": 8, "micro_batch_size": 2,
                                      "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "progress": False,
                                      "eval_interval": 0, "eval_iters": 0, "precision": "fp32"}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return from_dict(ToyRunConfig, base)
