"""The schema of a decoder-only model: dense (LLaMA 2/3/3.1, Qwen2/2.5, Qwen3) or mixture-of-experts (Qwen3-MoE,
DeepSeek-V3 with multi-latent attention)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from loong.core.config.checks import (
    Check,
    ExistingDir,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)
from loong.core.errors import LoongError


@dataclass
class RopeScaling:
    """LLaMA 3.1-style frequency scaling (HF ``rope_scaling`` with ``rope_type: llama3``)."""

    factor: PositiveFloat = 8.0
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: PositiveInt = 8192


@dataclass
class YarnScaling:
    """YaRN RoPE scaling of multi-latent attention's rope channels (DeepSeek-V3; HF ``rope_type: yarn``):
    ``beta_fast``/``beta_slow`` bound the interpolation ramp, ``mscale``/``mscale_all_dim`` set the attention
    temperature (cos/sin times ``m(mscale)/m(mscale_all_dim)``, the softmax scale times ``m(mscale_all_dim)²``)."""

    factor: PositiveFloat = 40.0
    original_max_position_embeddings: PositiveInt = 4096
    beta_fast: PositiveFloat = 32.0
    beta_slow: PositiveFloat = 1.0
    mscale: NonNegativeFloat = 1.0
    mscale_all_dim: NonNegativeFloat = 0.0


@dataclass
class LoraConfig:
    """Low-rank adapters on the megatron linear layers; ``rank=0`` disables them."""

    rank: Annotated[int, Check(ge=0, note="0: off")] = 0
    alpha: PositiveFloat = 16.0
    dropout: Annotated[float, Check(ge=0, lt=1)] = 0.0
    targets: Annotated[list[NonEmptyStr], Check(nonempty=True)] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


@dataclass
class DenseModelConfig:
    """Shape and family switches of a dense decoder. ``family`` selects the HF mapping.

    ``fused_kernels``: ``auto`` takes loong-kernels' fused RMSNorm, SwiGLU, RoPE and (at TP = 1) linear +
    cross-entropy where the accelerator reports Triton, megatron-core's PyTorch modules elsewhere; ``on``
    requires them (an error where Triton is not reported, and an unsupported input fails instead of
    falling back); ``off`` keeps megatron-core's modules (see :mod:`loong.llm.models.fused`).

    Starting weights of a fresh run: ``init_from_hf`` (a Hugging Face folder) or ``init_from`` (a loong-llm
    checkpoint: a run, checkpoints or step folder, its newest step; any layout it was saved at); either sets the
    shape from what it names (:mod:`loong.llm.checkpoint_init`). In loong-vlm this is ``foundation.init_from``.

    Activation recomputation (megatron-core's): ``recompute=selective`` recomputes the core attention in
    backward instead of keeping its inputs; ``full`` keeps only each block's input and recomputes whole
    layers, in chunks of ``recompute_num_layers`` (megatron's ``uniform`` method). Same numbers, less memory,
    about one more forward of compute for ``full``.

    Mixture of experts (``num_experts`` set; every layer's MLP is a megatron-core ``MoELayer``):
    ``moe_ffn_hidden_size`` is each expert's width, ``moe_router_topk`` the experts per token,
    ``norm_topk_prob`` renormalises the top-k softmax probabilities to sum to 1 (HF ``norm_topk_prob``),
    ``moe_aux_loss_coeff`` weighs megatron's load-balancing loss (HF ``router_aux_loss_coef``; added to the
    gradient through megatron's ``MoEAuxLossAutoScaler``, logged as ``moe_aux_loss``),
    ``moe_token_dispatcher`` is megatron's token dispatcher (``alltoall`` or ``allgather``; both run on gloo).
    ``moe_grouped_mm`` runs a rank's experts as two ``torch._grouped_mm`` calls instead of megatron's loop over
    ``SequentialMLP`` experts (same parameters and checkpoints; ``models/grouped_experts.py``): ``auto`` where the
    accelerator reports ``grouped_mm`` (CUDA sm90+) and FP8 is off, ``true`` always, ``false`` never.

    DeepSeek-V3 (``family=deepseek_v3``, ``deepseek_v32``; see docs/moe.md): multi-latent attention when
    ``kv_lora_rank`` is set (``q_lora_rank`` None = a direct query projection; ``qk_nope_head_dim`` +
    ``qk_rope_head_dim`` per query/key head, ``v_head_dim`` per value head); ``moe_shared_experts`` shared SwiGLU
    experts of ``moe_ffn_hidden_size`` each; ``first_k_dense_replace`` dense first layers;
    ``moe_router_score_function=sigmoid`` with ``moe_router_enable_expert_bias`` (aux-loss-free balancing, bias
    moved by ``moe_router_bias_update_rate`` per step), group-limited routing (``moe_router_num_groups``,
    ``moe_router_group_topk``), ``moe_routed_scaling_factor``; ``mtp_num_layers`` multi-token-prediction modules
    whose loss, times ``mtp_loss_scaling_factor``, joins the gradient (megatron's ``MTPLossAutoScaler``).
    DeepSeek-V3.2's sparse attention (DSA, ``family=deepseek_v32``; ``models/deepseek_v32/``): a lightning indexer
    of ``index_n_heads`` × ``index_head_dim`` picks ``index_topk`` keys per query; ``dsa_stage`` is ``dense_warmup``
    (full causal attention; the training task freezes everything but the indexers, which learn from a KL to the
    attention distribution) or ``sparse`` (attention over the selected keys, the indexer's KL over them too, on
    detached inputs); ``indexer_loss_coeff`` weighs the indexer loss (logged unweighted as ``indexer_loss``).
    ``dsa_head_chunks`` > 1 runs the absorbed attention core in that many head groups, each recomputed in the
    backward instead of keeping its ``[tokens, heads, 576]`` query and ``[tokens, heads, 512]`` output (18 GB per
    layer at 64K tokens): the same numbers, one more sparse-attention forward per layer.
    """

    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32"] = "llama"
    preset: Annotated[str, Check(nonempty=True)] = "custom"
    num_layers: PositiveInt = 2
    hidden_size: PositiveInt = 64
    ffn_hidden_size: PositiveInt = 256
    num_attention_heads: PositiveInt = 4
    num_query_groups: PositiveInt = 4
    head_dim: PositiveInt | None = None
    vocab_size: PositiveInt = 512
    max_position_embeddings: PositiveInt = 2048
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_yarn: YarnScaling | None = None
    norm_eps: PositiveFloat = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    init_std: NonNegativeFloat = 0.02
    init_from_hf: ExistingDir | None = None
    init_from: ExistingDir | None = None
    fused_kernels: Literal["auto", "on", "off"] = "auto"
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_num_layers: PositiveInt = 1
    num_experts: PositiveInt | None = None
    moe_ffn_hidden_size: PositiveInt | None = None
    moe_router_topk: PositiveInt = 2
    norm_topk_prob: bool = True
    moe_aux_loss_coeff: NonNegativeFloat = 0.001
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    moe_grouped_mm: bool | Literal["auto"] = "auto"
    q_lora_rank: PositiveInt | None = None
    kv_lora_rank: PositiveInt | None = None
    qk_nope_head_dim: PositiveInt = 128
    qk_rope_head_dim: PositiveInt = 64
    v_head_dim: PositiveInt = 128
    moe_shared_experts: NonNegativeInt = 0
    first_k_dense_replace: NonNegativeInt = 0
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: NonNegativeFloat = 1e-3
    moe_router_num_groups: PositiveInt | None = None
    moe_router_group_topk: PositiveInt | None = None
    moe_routed_scaling_factor: PositiveFloat | None = None
    mtp_num_layers: NonNegativeInt = 0
    mtp_loss_scaling_factor: NonNegativeFloat = 0.1
    index_n_heads: PositiveInt = 64
    index_head_dim: PositiveInt = 128
    index_topk: PositiveInt = 2048
    dsa_stage: Literal["dense_warmup", "sparse"] = "sparse"
    indexer_loss_coeff: NonNegativeFloat = 1.0
    dsa_head_chunks: PositiveInt = 1
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

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V3): keys and values come from a ``kv_lora_rank`` latent."""
        return self.kv_lora_rank is not None

    @property
    def is_dsa(self) -> bool:
        """DeepSeek-V3.2's sparse attention: MLA plus the lightning indexer."""
        return self.family == "deepseek_v32"

    @property
    def num_dense_layers(self) -> int:
        """Leading layers with a dense MLP (``first_k_dense_replace``; all of them for a dense model)."""
        return min(self.first_k_dense_replace, self.num_layers) if self.is_moe else self.num_layers

    def _attention_parameters(self) -> int:
        d, h = self.hidden_size, self.num_attention_heads
        if not self.is_mla:
            q = h * self.kv_channels
            kv = self.num_query_groups * self.kv_channels
            attn = d * (q + 2 * kv) + q * d + (q + 2 * kv if self.qkv_bias else 0)
            return attn + (2 * self.kv_channels if self.qk_norm else 0)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        r, c = self.q_lora_rank, self.kv_lora_rank
        q = d * h * qk if r is None else d * r + r + r * h * qk  # (down, norm, up) or direct
        kv = d * (c + self.qk_rope_head_dim) + c + c * h * (self.qk_nope_head_dim + self.v_head_dim)
        attn = q + kv + h * self.v_head_dim * d
        if self.is_dsa:  # the lightning indexer: wq_b from the q latent, wk + its LayerNorm, head weights
            ih, idim = self.index_n_heads, self.index_head_dim
            attn += (r or d) * ih * idim + d * idim + 2 * idim + d * ih
        return attn

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count (embeddings included once when tied; multi-token-prediction modules included);
        ``active``: only the ``moe_router_topk`` routed experts a token runs through (what its FLOPs see)."""
        d, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        attn = self._attention_parameters()
        dense_mlp = 3 * d * f
        moe_mlp = 0
        if self.is_moe:
            fe = self.expert_ffn_hidden_size
            experts = self.moe_router_topk if active else self.num_experts
            moe_mlp = (experts + self.moe_shared_experts) * 3 * d * fe + self.num_experts * d  # + router
        n_dense = self.num_dense_layers
        layers = n_dense * (attn + dense_mlp + 2 * d) + (self.num_layers - n_dense) * (attn + moe_mlp + 2 * d)
        # an MTP module: two norms, the [2d -> d] projection, one (MoE, when the model has experts) layer and
        # its final norm; it shares the embedding and the output layer
        mtp = self.mtp_num_layers * (3 * d + 2 * d * d + attn + (moe_mlp if self.is_moe else dense_mlp) + 2 * d)
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        return layers + mtp + emb + d

    def validate(self, path: str) -> None:
        """Checks that do not depend on the layout (those are in :func:`check_model_layout`)."""
        if self.init_from is not None and self.init_from_hf is not None:
            raise LoongError(f"{path}.init_from and {path}.init_from_hf both name starting weights; give one")
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
        elif self.family in ("qwen3_moe", "deepseek_v3", "deepseek_v32"):
            raise LoongError(f"{path}: family={self.family} needs num_experts")
        if self.family in ("deepseek_v3", "deepseek_v32") and not self.is_mla:
            raise LoongError(f"{path}: family={self.family} needs kv_lora_rank (multi-latent attention)")
        if self.moe_router_num_groups is not None and self.is_moe:
            g, k = self.moe_router_num_groups, self.moe_router_group_topk or 0
            if self.num_experts % g or not 1 <= k <= g or self.moe_router_topk % k:
                raise LoongError(f"{path}: group-limited routing needs moe_router_num_groups={g} to divide "
                                 f"num_experts={self.num_experts} and moe_router_group_topk={k} in 1..{g} to "
                                 f"divide moe_router_topk={self.moe_router_topk}")
        if self.is_dsa:
            if self.q_lora_rank is None:
                raise LoongError(f"{path}: family=deepseek_v32 needs q_lora_rank (the indexer reads the q latent)")
            if not self.qk_rope_head_dim <= self.index_head_dim or self.index_topk < 1 or self.index_n_heads < 1:
                raise LoongError(f"{path}: DSA needs index_n_heads >= 1, index_topk >= 1 and index_head_dim="
                                 f"{self.index_head_dim} >= qk_rope_head_dim={self.qk_rope_head_dim}")
            if self.dsa_stage not in ("dense_warmup", "sparse"):
                raise LoongError(f"{path}: dsa_stage={self.dsa_stage!r} is not dense_warmup or sparse")
            if self.dsa_head_chunks < 1 or self.num_attention_heads % self.dsa_head_chunks:
                raise LoongError(f"{path}.dsa_head_chunks={self.dsa_head_chunks}: must be >= 1 and divide "
                                 f"num_attention_heads={self.num_attention_heads}")


#: Fields a Hugging Face config.json does not hold: how to build, initialise and train the model, not its
#: architecture. ``model.init_from_hf`` takes every other field from the folder and these from the run's config
#: (:func:`loong.llm.hf.model_config_from_hf`); a test checks that every field is one or the other.
TRAINING_FIELDS: tuple[str, ...] = (
    "init_from_hf", "init_from", "init_std", "fused_kernels", "recompute", "recompute_num_layers", "moe_token_dispatcher",
    "moe_grouped_mm", "moe_router_bias_update_rate", "mtp_loss_scaling_factor", "dsa_stage", "indexer_loss_coeff",
    "dsa_head_chunks", "lora",
)

def training_flops_per_token(model: DenseModelConfig, seq_length: int) -> float:
    """Training FLOPs per token: 6·N (N without the input embedding; for MoE the parameters a token
    is routed through) + 12·L·heads·head_dim·seq.

    The attention term counts the full (non-causal) score matrix, as PaLM (appendix B),
    Megatron-LM and torchtitan do, so MFU figures compare across frameworks.
    """
    n = model.num_parameters(active=True) - (0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size)
    if model.is_mla:  # q·k over qk_nope + qk_rope channels, p·v over v_head_dim
        width = model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim
        keys = min(seq_length, model.index_topk) if model.is_dsa and model.dsa_stage == "sparse" else seq_length
        attn = 6 * (model.num_layers + model.mtp_num_layers) * model.num_attention_heads * width * keys
        if model.is_dsa:  # the indexer's scores over every earlier key
            attn += 6 * model.num_layers * model.index_n_heads * model.index_head_dim * seq_length
        return 6.0 * n + attn
    attn = 12 * model.num_layers * model.num_attention_heads * model.kv_channels * seq_length
    return 6.0 * n + attn


def runs_sequence_parallel(model: DenseModelConfig, tp: int, requested: bool) -> bool:
    """Whether the model runs megatron's sequence parallelism: asked for (``parallel.sequence_parallel``, here
    ``requested``) or implied, at ``tp > 1``. megatron's MoELayer trains with TP > 1 only under it, and MLA's KV
    down-projection splits its rope key correctly only under it (``deepseek_v3/spec.py``)."""
    return tp > 1 and (requested or model.is_moe or model.is_mla)


def check_model_layout(model: DenseModelConfig, tp: int, pp: int, seq_length: int, ep: int = 1,
                       etp: int | None = None, cp: int = 1, sequence_parallel: bool = False) -> None:
    """Errors a user can fix in the config: TP/PP/EP that do not divide the model, too-long sequences, sequences
    that context or sequence parallelism (``sequence_parallel``: ``parallel.sequence_parallel``) cannot split."""
    if model.num_attention_heads % tp:
        raise LoongError(
            f"parallel.tp={tp} does not divide the model's {model.num_attention_heads} attention heads"
        )
    if model.is_mla and model.mtp_num_layers and pp > 1:
        raise LoongError(f"parallel.pp={pp}: multi-token prediction (mtp_num_layers={model.mtp_num_layers}) is "
                         "only supported without pipeline parallelism so far")
    if model.num_query_groups % tp:
        raise LoongError(f"parallel.tp={tp} does not divide the model's {model.num_query_groups} KV heads")
    if model.ffn_hidden_size % tp:
        raise LoongError(f"parallel.tp={tp} does not divide ffn_hidden_size={model.ffn_hidden_size}")
    if ep > 1 and not model.is_moe:
        raise LoongError(f"parallel.ep={ep}: dense models have no experts (expert parallelism is for MoE)")
    if model.is_moe:
        if ep > model.num_experts:
            raise LoongError(f"parallel.ep={ep} is more than the model's {model.num_experts} experts: every "
                             "expert-parallel rank needs at least one expert")
        if model.num_experts % ep:
            raise LoongError(f"parallel.ep={ep} does not divide the model's {model.num_experts} experts")
        if model.expert_ffn_hidden_size % (etp or tp):
            raise LoongError(f"the expert tensor-parallel size {etp or tp} does not divide "
                             f"moe_ffn_hidden_size={model.expert_ffn_hidden_size}")
    if pp > model.num_layers:  # pp here is parallel.pp x parallel.vpp: the model chunks the layers are split into
        raise LoongError(f"parallel.pp={pp}: more pipeline chunks (parallel.pp x parallel.vpp) than the model's "
                         f"{model.num_layers} layers; every chunk needs at least one layer")
    if model.num_layers % pp:
        raise LoongError(f"parallel.pp={pp} does not divide the model's {model.num_layers} layers")
    if seq_length > model.max_position_embeddings:
        raise LoongError(
            f"train.seq_length={seq_length} is larger than the model's maximum "
            f"max_position_embeddings={model.max_position_embeddings}"
        )
    from loong.core.engines.megatron.layout import check_sequence_split

    check_sequence_split(seq_length, tp, cp, runs_sequence_parallel(model, tp, sequence_parallel),
                         why="parallel.sequence_parallel=true" if sequence_parallel else
                         "a MoE / MLA model runs sequence-parallel at tp > 1")
