"""A dense family's Hugging Face declaration and its config.json translation, both ways.

Each family folder (``llama/``, ``qwen2/``, ``qwen3/``) declares one :class:`HFFamily`; the reading
and writing here is shared. Reading accepts both the legacy (``rope_theta`` + ``rope_scaling``) and the
transformers 5.x (``rope_parameters``) RoPE forms; writing emits both, so transformers 4.x and 5.x read
the same values back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig, RopeScaling

# HF fields carried through Loong untouched (kept in ``DenseModelConfig.extra["hf"]``).
_PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class HFFamily:
    """What differs between dense families on the Hugging Face side.

    ``qkv_bias``/``qk_norm`` say which optional tensors every checkpoint of the family has;
    ``head_dim_default`` is the HF config class's default when config.json omits ``head_dim``
    (None: ``hidden_size // num_attention_heads``).
    """

    name: str
    architectures: tuple[str, ...]
    model_type: str
    qkv_bias: bool
    qk_norm: bool
    head_dim_default: int | None = None
    max_position_default: int = 2048
    sliding_window_field: bool = False

    def config_from_hf(self, hf: dict[str, Any]) -> DenseModelConfig:
        """A :class:`DenseModelConfig` from a parsed config.json (legacy or 5.x RoPE form)."""
        where = f"{self.architectures[0]} config"
        if hf.get("hidden_act", "silu") != "silu":
            raise LoongError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise LoongError(f"{where}: mlp_bias=true is not supported")
        if not self.qkv_bias and hf.get("attention_bias"):
            raise LoongError(f"{where}: attention_bias=true (biased attention projections) is not supported")
        if self.sliding_window_field and hf.get("use_sliding_window"):
            raise LoongError(f"{where}: use_sliding_window=true is not supported")
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or self.head_dim_default
        max_pos = int(hf.get("max_position_embeddings", self.max_position_default))
        theta, scaling = _read_rope(hf, max_pos, where)
        extra_hf = {k: hf[k] for k in _PASSTHROUGH if hf.get(k) is not None}
        return DenseModelConfig(
            family=self.name,  # type: ignore[arg-type]
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            ffn_hidden_size=int(hf["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            head_dim=None if head_dim in (None, hidden // heads) else int(head_dim),
            vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=max_pos,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            init_std=float(hf.get("initializer_range", 0.02)),
            extra={"hf": extra_hf} if extra_hf else {},
        )

    def hf_config_dict(self, cfg: DenseModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
        """The config.json for ``cfg``; ``dtype`` (e.g. ``"bfloat16"``) names the saved tensors' dtype."""
        if cfg.family != self.name:
            raise LoongError(f"model.family={cfg.family!r} cannot be written as a {self.architectures[0]}")
        if cfg.qkv_bias != self.qkv_bias or cfg.qk_norm != self.qk_norm:
            raise LoongError(
                f"{self.architectures[0]} has qkv_bias={self.qkv_bias}, qk_norm={self.qk_norm}; "
                f"the model has qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}"
            )
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        out: dict[str, Any] = {
            "architectures": [self.architectures[0]],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups,
            "head_dim": cfg.kv_channels,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.qkv_bias,
            "attention_dropout": 0.0,
            "initializer_range": cfg.init_std,
            "use_cache": True,
            "dtype": dtype,
            "torch_dtype": dtype,
        }
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if self.sliding_window_field:
            out["use_sliding_window"] = False
            out["max_window_layers"] = cfg.num_layers
        if cfg.rope_scaling is not None:
            rs = cfg.rope_scaling
            scaling = {
                "rope_type": "llama3",
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
            out["rope_scaling"] = dict(scaling)  # transformers 4.x
            rope.update(scaling)
        out["rope_parameters"] = rope  # transformers 5.x
        out.update(cfg.extra.get("hf", {}))
        return out


def _read_rope(hf: dict[str, Any], max_pos: int, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either config.json form.

    transformers 5.x gives ``rope_scaling`` precedence over ``rope_parameters``; so do we.
    """
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise LoongError(f"{where}: per-layer-type rope parameters are not supported")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise LoongError(f"{where}: rope type {kind!r} is not supported (only default and llama3)")
    return theta, RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", max_pos)),
    )
