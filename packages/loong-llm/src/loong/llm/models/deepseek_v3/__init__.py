"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-latent attention with YaRN RoPE on the decoupled rope channels,
DeepSeekMoE (shared experts + routed experts, sigmoid scores, aux-loss-free expert bias, group-limited top-k,
routed scaling factor), ``first_k_dense_replace`` dense first layers, and multi-token prediction modules stored
after the decoder layers as ``model.layers.{num_hidden_layers + j}.*`` (DeepSeek's release; transformers' model
ignores them). The megatron side is in :mod:`.spec`, the tensor mapping in :mod:`.mapping`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig, YarnScaling
from loong.llm.models.hf_config import _PASSTHROUGH, HFFamily


def _read_rope(hf: dict[str, Any], where: str) -> tuple[float, YarnScaling | None]:
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise LoongError(f"{where}: rope type {kind!r} is not supported (only default and yarn)")
    if rope.get("attention_factor") is not None:
        raise LoongError(f"{where}: an explicit yarn attention_factor is not supported (mscale/mscale_all_dim are)")
    return theta, YarnScaling(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 1.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )


@dataclass(frozen=True)
class DeepSeekHFFamily(HFFamily):
    """config.json ⇄ :class:`DenseModelConfig` for DeepSeek-V3 (and, with the indexer fields, V3.2)."""

    def _check(self, hf: dict[str, Any], where: str) -> None:
        unsupported = {
            "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
            "attention_bias": (bool(hf.get("attention_bias", False)), False),
            "scoring_func": (hf.get("scoring_func", "sigmoid"), "sigmoid"),
            "topk_method": (hf.get("topk_method", "noaux_tc"), "noaux_tc"),
            "norm_topk_prob": (bool(hf.get("norm_topk_prob", True)), True),
            "moe_layer_freq": (hf.get("moe_layer_freq", 1), 1),
            "rope_interleave": (bool(hf.get("rope_interleave", True)), True),
            "tie_word_embeddings": (bool(hf.get("tie_word_embeddings", False)), False),
        }
        for key, (got, want) in unsupported.items():
            if got != want:
                raise LoongError(f"{where}: {key}={got!r} is not supported (only {want!r})")

    def config_from_hf(self, hf: dict[str, Any]) -> DenseModelConfig:
        where = f"{self.architectures[0]} config"
        self._check(hf, where)
        heads = int(hf["num_attention_heads"])
        theta, scaling = _read_rope(hf, where)
        experts = int(hf.get("n_routed_experts") or 0)
        extra_hf = {k: hf[k] for k in _PASSTHROUGH if hf.get(k) is not None}
        groups = hf.get("n_group")
        return DenseModelConfig(
            family=self.name,  # type: ignore[arg-type]
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=int(hf["hidden_size"]),
            ffn_hidden_size=int(hf["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=heads,
            vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", self.max_position_default)),
            rope_theta=theta,
            rope_yarn=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)),
            q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            num_experts=experts or None,
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            moe_router_topk=int(hf.get("num_experts_per_tok", 8)),
            norm_topk_prob=True,
            moe_shared_experts=int(hf.get("n_shared_experts") or 0),
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=int(groups) if groups and int(groups) > 1 else None,
            moe_router_group_topk=int(hf["topk_group"]) if groups and int(groups) > 1 else None,
            moe_routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            # DeepSeek-V3's complementary sequence-wise balance loss (alpha = 1e-4 in the paper)
            moe_aux_loss_coeff=float(hf.get("aux_loss_alpha", 1e-4)) if hf.get("seq_aux", True) else 0.0,
            mtp_num_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0),
            extra={"hf": extra_hf} if extra_hf else {},
        )

    def hf_config_dict(self, cfg: DenseModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
        if cfg.family != self.name:
            raise LoongError(f"model.family={cfg.family!r} cannot be written as a {self.architectures[0]}")
        if not cfg.is_mla or not cfg.is_moe or cfg.moe_router_score_function != "sigmoid":
            raise LoongError(f"{self.architectures[0]} needs kv_lora_rank, num_experts and sigmoid routing")
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_yarn is not None:
            rs = cfg.rope_yarn
            rope.update(rope_type="yarn", factor=rs.factor, original_max_position_embeddings=rs.original_max_position_embeddings,
                        beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
        out: dict[str, Any] = {
            "architectures": [self.architectures[0]],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            "moe_intermediate_size": cfg.expert_ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_attention_heads,
            "n_shared_experts": cfg.moe_shared_experts,
            "n_routed_experts": cfg.num_experts,
            "routed_scaling_factor": cfg.moe_routed_scaling_factor or 1.0,
            "kv_lora_rank": cfg.kv_lora_rank,
            "q_lora_rank": cfg.q_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "n_group": cfg.moe_router_num_groups or 1,
            "topk_group": cfg.moe_router_group_topk or 1,
            "num_experts_per_tok": cfg.moe_router_topk,
            "first_k_dense_replace": cfg.num_dense_layers,
            "norm_topk_prob": True,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "seq_aux": cfg.moe_aux_loss_coeff > 0,
            "aux_loss_alpha": cfg.moe_aux_loss_coeff,
            "num_nextn_predict_layers": cfg.mtp_num_layers,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_parameters": rope,  # transformers 5.x
            "rope_interleave": True,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": cfg.init_std,
            "use_cache": True,
            "dtype": dtype,
            "torch_dtype": dtype,
        }
        if cfg.rope_yarn is not None:  # transformers 4.x and DeepSeek's own code read rope_scaling
            out["rope_scaling"] = {**rope, "type": "yarn"}
        out.update(cfg.extra.get("hf", {}))
        return out


FAMILY = DeepSeekHFFamily(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_type="deepseek_v3",
    qkv_bias=False,
    qk_norm=False,
    max_position_default=4096,
)

config_from_hf = FAMILY.config_from_hf
hf_config_dict = FAMILY.hf_config_dict

__all__ = ["FAMILY", "DeepSeekHFFamily", "config_from_hf", "hf_config_dict"]
