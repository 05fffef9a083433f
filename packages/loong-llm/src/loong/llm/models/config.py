"""The schema of a decoder-only model: dense (LLaMA 2/3/3.1, Qwen2/2.5, Qwen3) or mixture-of-experts (Qwen3-MoE)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from loong.core.errors import LoongError


@dataclass
class RopeScaling:
    """LLaMA 3.1-style frequency scaling (HF ``rope_scaling`` with ``rope_type: llama3``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class LoraConfig:
    """Low-rank adapters on the megatron linear layers; ``rank=0`` disables them."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


@dataclass
class DenseModelConfig:
    """Shape and family switches of a dense decoder. ``family`` selects the HF mapping.

    ``fused_kernels``: ``auto`` takes loong-kernels' fused RMSNorm, SwiGLU, RoPE and (at TP = 1) linear +
    cross-entropy where the accelerator reports Triton, megatron-core's PyTorch modules elsewhere; ``on``
    requires them (an error where Triton is not reported, and an unsupported input fails instead of
    falling back); ``off`` keeps megatron-core's modules (see :mod:`loong.llm.models.fused`).

    Mixture of experts (``num_experts`` set; every layer's MLP is a megatron-core ``MoELayer``):
    ``moe_ffn_hidden_size`` is each expert's width, ``moe_router_topk`` the experts per token,
    ``norm_topk_prob`` renormalises the top-k softmax probabilities to sum to 1 (HF ``norm_topk_prob``),
    ``moe_aux_loss_coeff`` weighs megatron's load-balancing loss (HF ``router_aux_loss_coef``; added to the
    gradient through megatron's ``MoEAuxLossAutoScaler``, logged as ``moe_aux_loss``),
    ``moe_token_dispatcher`` is megatron's token dispatcher (``alltoall`` or ``allgather``; both run on gloo).
    """

    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = "llama"
    preset: str = "custom"
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int = 4
    head_dim: int | None = None
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    init_std: float = 0.02
    init_from_hf: str | None = None
    fused_kernels: Literal["auto", "on", "off"] = "auto"
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    norm_topk_prob: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    lora: LoraConfig = field(default_factory=LoraConfig)
    extra: dict = field(default_factory=dict)

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count (embeddings included once when tied); ``active``: only the ``moe_router_topk``
        experts a token runs through (what its FLOPs see)."""
        d, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        q = self.num_attention_heads * self.kv_channels
        kv = self.num_query_groups * self.kv_channels
        attn = d * (q + 2 * kv) + q * d + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * self.kv_channels if self.qk_norm else 0
        if self.is_moe:
            experts = self.moe_router_topk if active else self.num_experts
            mlp = experts * 3 * d * self.expert_ffn_hidden_size + self.num_experts * d  # + router
        else:
            mlp = 3 * d * f
        layer = attn + mlp + 2 * d
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + d

    def validate(self, path: str) -> None:
        """Checks that do not depend on the layout (those are in :func:`check_model_layout`)."""
        if self.num_attention_heads % self.num_query_groups:
            raise LoongError(
                f"{path}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise LoongError(f"{path}: hidden_size is not divisible by num_attention_heads; set head_dim")
        if self.is_moe:
            if self.num_experts < 1 or not 1 <= self.moe_router_topk <= self.num_experts:
                raise LoongError(f"{path}: moe_router_topk={self.moe_router_topk} must be in 1..num_experts="
                                 f"{self.num_experts}")
        elif self.family == "qwen3_moe":
            raise LoongError(f"{path}: family=qwen3_moe needs num_experts")


def training_flops_per_token(model: DenseModelConfig, seq_length: int) -> float:
    """Training FLOPs per token: 6·N (N without the input embedding; for MoE the parameters a token
    is routed through) + 12·L·heads·head_dim·seq.

    The attention term counts the full (non-causal) score matrix, as PaLM (appendix B),
    Megatron-LM and torchtitan do, so MFU figures compare across frameworks.
    """
    n = model.num_parameters(active=True) - (0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size)
    attn = 12 * model.num_layers * model.num_attention_heads * model.kv_channels * seq_length
    return 6.0 * n + attn


def check_model_layout(model: DenseModelConfig, tp: int, pp: int, seq_length: int, ep: int = 1,
                       etp: int | None = None) -> None:
    """Errors a user can fix in the config: TP/PP/EP that do not divide the model, too-long sequences."""
    if model.num_attention_heads % tp:
        raise LoongError(
            f"parallel.tp={tp} does not divide the model's {model.num_attention_heads} attention heads"
        )
    if model.num_query_groups % tp:
        raise LoongError(f"parallel.tp={tp} does not divide the model's {model.num_query_groups} KV heads")
    if model.ffn_hidden_size % tp:
        raise LoongError(f"parallel.tp={tp} does not divide ffn_hidden_size={model.ffn_hidden_size}")
    if ep > 1 and not model.is_moe:
        raise LoongError(f"parallel.ep={ep}: dense models have no experts (expert parallelism is for MoE)")
    if model.is_moe:
        if model.num_experts % ep:
            raise LoongError(f"parallel.ep={ep} does not divide the model's {model.num_experts} experts")
        if model.expert_ffn_hidden_size % (etp or tp):
            raise LoongError(f"the expert tensor-parallel size {etp or tp} does not divide "
                             f"moe_ffn_hidden_size={model.expert_ffn_hidden_size}")
    if model.num_layers % pp:
        raise LoongError(f"parallel.pp={pp} does not divide the model's {model.num_layers} layers")
    if seq_length > model.max_position_embeddings:
        raise LoongError(
            f"train.seq_length={seq_length} is larger than the model's maximum "
            f"max_position_embeddings={model.max_position_embeddings}"
        )
