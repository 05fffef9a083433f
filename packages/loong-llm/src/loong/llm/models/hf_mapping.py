"""Hugging Face <-> Loong weights, one native tensor at a time (:func:`hf_to_native_key`, :func:`native_to_hf_key`)
or a whole state dict (:func:`hf_to_native`, :func:`native_to_hf`: the same mapping key by key): pure tensor
rearrangement, dtypes kept. The dense and Qwen3-MoE families are mapped here; DeepSeek-V3/V3.2 (multi-latent
attention, per-layer keys) in ``deepseek_v3/mapping.py``.

Loong's side is keyed like :func:`loong.core.engines.megatron.state.gather_full_state` (megatron sharded keys, layers
stacked on a leading axis). The mapping is exactly invertible: HF -> Loong -> HF is bit-exact.
Which optional tensors exist (q/k/v bias, QK norm, a separate ``lm_head``) follows the
:class:`DenseModelConfig` flags, which each family's :class:`HFFamily` declaration sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.hf_config import HFFamily

Tensor = torch.Tensor

_EMB, _FINAL, _OUT = (
    "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
)
_L = "decoder.layers."
_QKV_W, _QKV_B = _L + "self_attention.linear_qkv.weight", _L + "self_attention.linear_qkv.bias"
_FC1 = _L + "mlp.linear_fc1.weight"
# (native stacked key, HF per-layer suffix) for tensors that map one to one.
_PLAIN = (
    (_L + "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    (_L + "self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    (_L + "mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    (_L + "mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)
# Mixture of experts (every layer): the router and the experts stacked as [layers, experts, ...].
_ROUTER = _L + "mlp.router.weight"
_EXP_FC1, _EXP_FC2 = _L + "mlp.experts.experts.linear_fc1.weight", _L + "mlp.experts.experts.linear_fc2.weight"
_DENSE_MLP = (_FC1, _PLAIN[3][0])
_QK_NORM = (
    (_L + "self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    (_L + "self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)
# HF keys that carry no weights (old checkpoints saved the RoPE buffer).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _mla_mapping() -> Any:
    """DeepSeek-V3/V3.2's per-key mapping module (V3.2's indexers included; imported when first needed)."""
    from loong.llm.models.deepseek_v3 import mapping

    return mapping


def native_shapes(cfg: DenseModelConfig) -> dict[str, tuple[int, ...]]:
    """The whole-tensor shape of every native key for ``cfg``."""
    if cfg.is_mla:  # DeepSeek-V3 / V3.2: per-layer keys, their own mapping
        return _mla_mapping().native_shapes(cfg)
    n, d, f, v, hd = cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.kv_channels
    q, qkv = cfg.num_attention_heads * hd, (cfg.num_attention_heads + 2 * cfg.num_query_groups) * hd
    shapes = {
        _EMB: (v, d),
        _FINAL: (d,),
        _PLAIN[0][0]: (n, d),
        _PLAIN[1][0]: (n, d, q),
        _PLAIN[2][0]: (n, d),
        _PLAIN[3][0]: (n, d, f),
        _QKV_W: (n, qkv, d),
        _FC1: (n, 2 * f, d),
    }
    if cfg.is_moe:
        e, fe = cfg.num_experts, cfg.expert_ffn_hidden_size
        for key in _DENSE_MLP:
            del shapes[key]
        shapes.update({_ROUTER: (n, e, d), _EXP_FC1: (n, e, 2 * fe, d), _EXP_FC2: (n, e, d, fe)})
    if cfg.qkv_bias:
        shapes[_QKV_B] = (n, qkv)
    if cfg.qk_norm:
        shapes.update({key: (n, hd) for key, _ in _QK_NORM})
    if not cfg.tie_word_embeddings:
        shapes[_OUT] = (v, d)
    return shapes


def _check_shapes(state: Mapping[str, Tensor], cfg: DenseModelConfig, what: str) -> None:
    for key, shape in native_shapes(cfg).items():
        if key not in state:
            raise LoongError(f"{what}: missing {key}")
        if tuple(state[key].shape) != shape:
            raise LoongError(f"{what}: {key} has shape {tuple(state[key].shape)}, the config implies {shape}")


def _group_view(t: Tensor, rows: int, cfg: DenseModelConfig, name: str) -> Tensor:
    """``t`` [groups*rows, ...] viewed as [groups, rows, ...], with a clear error on a shape mismatch."""
    g = cfg.num_query_groups
    if t.shape[0] != g * rows:
        raise LoongError(f"{name} has {t.shape[0]} rows, the config implies {g * rows}")
    return t.reshape(g, rows, *t.shape[1:])


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: DenseModelConfig, name: str) -> Tensor:
    """HF q/k/v -> megatron's per-query-group interleave [q heads of group, k head, v head]."""
    hd = cfg.kv_channels
    per_group = cfg.num_attention_heads // cfg.num_query_groups * hd
    parts = [
        _group_view(q, per_group, cfg, name.replace("*", "q")),
        _group_view(k, hd, cfg, name.replace("*", "k")),
        _group_view(v, hd, cfg, name.replace("*", "v")),
    ]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(qkv: Tensor, cfg: DenseModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`_fuse_qkv`."""
    hd = cfg.kv_channels
    per_group = cfg.num_attention_heads // cfg.num_query_groups * hd
    grouped = qkv.reshape(cfg.num_query_groups, per_group + 2 * hd, *qkv.shape[1:])
    q, k, v = grouped.split([per_group, hd, hd], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))  # type: ignore[return-value]


def _plain(cfg: DenseModelConfig) -> tuple[tuple[str, str], ...]:
    """The one-to-one (native key, HF suffix) pairs of ``cfg``."""
    plain = _PLAIN if not cfg.is_moe else tuple(p for p in _PLAIN if p[0] not in _DENSE_MLP)
    return plain + (_QK_NORM if cfg.qk_norm else ())


def _qkv_keys(cfg: DenseModelConfig) -> tuple[tuple[str, str], ...]:
    """(HF suffix kind, native key) of the fused QKV tensors ``cfg`` has."""
    return (("weight", _QKV_W), ("bias", _QKV_B)) if cfg.qkv_bias else (("weight", _QKV_W),)


def ignored_hf_key(key: str) -> bool:
    """An HF tensor that carries no weights (old checkpoints saved the RoPE buffer)."""
    return key.endswith(_IGNORED_SUFFIXES)


def is_stacked(key: str) -> bool:
    """Whether native tensor ``key`` stacks the decoder layers on its leading axis (DeepSeek-V3's per-layer keys,
    ``decoder.layers.{i}.…``, do not)."""
    return key.startswith(_L) and not key[len(_L):len(_L) + 1].isdigit()


def hf_to_native_key(key: str, take: Callable[[str], Tensor], cfg: DenseModelConfig,
                     layer: int | None = None) -> Tensor:
    """The native tensor ``key`` built from the HF tensors ``take(name)`` returns; with ``layer`` (a key
    :func:`is_stacked`), only that layer's slice ``[layer]``.

    Only the HF tensors asked for are read, so a converter can hold one native tensor (or layer slice) at a time.
    """
    if cfg.is_mla:
        if layer is not None:
            raise LoongError(f"{key}: a {cfg.family} model's native tensors are per layer, not stacked")
        return _mla_mapping().hf_to_native_key(key, take, cfg)
    n = cfg.num_layers
    layers = range(n) if layer is None else (layer,)

    def stacked(parts: list[Tensor]) -> Tensor:
        return torch.stack(parts) if layer is None else parts[0]

    def stack(suffix: str) -> Tensor:
        parts = [take(f"model.layers.{i}.{suffix}") for i in layers]
        odd = next((i for i, t in enumerate(parts) if t.shape != parts[0].shape), None)
        if odd is not None:  # torch.stack's own error names no tensor
            raise LoongError(f"model.layers.{odd}.{suffix} has shape {tuple(parts[odd].shape)}, "
                             f"model.layers.0.{suffix} has {tuple(parts[0].shape)}")
        return stacked(parts)

    single = {_EMB: "model.embed_tokens.weight", _FINAL: "model.norm.weight", _OUT: "lm_head.weight"}
    if key in single:
        return take(single[key])
    plain = dict(_plain(cfg))
    if key in plain:
        return stack(plain[key])
    qkv = {native: kind for kind, native in _qkv_keys(cfg)}
    if key in qkv:
        return stacked([
            _fuse_qkv(*(take(f"model.layers.{i}.self_attn.{p}_proj.{qkv[key]}") for p in "qkv"), cfg,
                      f"model.layers.{i}.self_attn.*_proj.{qkv[key]}")
            for i in layers
        ])
    if key == _ROUTER:
        return stack("mlp.gate.weight")
    if key in (_EXP_FC1, _EXP_FC2):
        experts = [[f"model.layers.{i}.mlp.experts.{e}." for e in range(cfg.num_experts)] for i in layers]
        if key == _EXP_FC2:
            return stacked([torch.stack([take(p + "down_proj.weight") for p in ps]) for ps in experts])
        return stacked([
            torch.stack([torch.cat([take(p + "gate_proj.weight"), take(p + "up_proj.weight")]) for p in ps])
            for ps in experts
        ])
    if key == _FC1:
        return stacked([
            torch.cat([take(f"model.layers.{i}.mlp.gate_proj.weight"), take(f"model.layers.{i}.mlp.up_proj.weight")])
            for i in layers
        ])
    raise LoongError(f"a {cfg.family} model has no native tensor {key}")


def extra_hf_keys(hf_keys: Iterable[str], used: set[str], cfg: DenseModelConfig) -> None:
    """Raise LoongError when HF tensors other than ``used`` (and the ignored / alias ones) are present."""
    aliases = _mla_mapping().hf_aliases(cfg) if cfg.is_mla else set()  # the MTP modules' embedding/head copies
    extra = sorted(k for k in hf_keys if k not in used and not ignored_hf_key(k) and k not in aliases
                   and not (cfg.tie_word_embeddings and k == "lm_head.weight"))  # transformers lists the tied alias
    if extra:
        hint = ("num_hidden_layers, num_nextn_predict_layers" if cfg.is_mla
                else "num_hidden_layers, attention_bias, tie_word_embeddings")
        raise LoongError(
            f"Hugging Face checkpoint has {len(extra)} tensors that a {cfg.family} model with this config "
            f"does not have, e.g. {extra[:3]} (check {hint})"
        )


def hf_to_native(hf_state: Mapping[str, Tensor], cfg: DenseModelConfig) -> dict[str, Tensor]:
    """Hugging Face tensors (``model.layers.{i}...``) -> Loong's stacked native tensors.

    Raises LoongError for missing tensors, unexpected ones (e.g. a bias the family does not have) and
    shapes that do not match ``cfg``.
    """
    used: set[str] = set()

    def take(key: str) -> Tensor:
        if key not in hf_state:
            raise LoongError(f"Hugging Face checkpoint has no tensor {key}")
        used.add(key)
        return hf_state[key]

    out = {key: hf_to_native_key(key, take, cfg) for key in native_shapes(cfg)}
    extra_hf_keys(hf_state, used, cfg)
    _check_shapes(out, cfg, "Hugging Face checkpoint")
    return out


def native_to_hf_key(key: str, tensor: Tensor, cfg: DenseModelConfig) -> dict[str, Tensor]:
    """The HF tensors of one native tensor; they may be views of ``tensor``."""
    if cfg.is_mla:
        return _mla_mapping().native_to_hf_key(key, tensor, cfg)
    single = {_EMB: "model.embed_tokens.weight", _FINAL: "model.norm.weight", _OUT: "lm_head.weight"}
    if key in single:
        return {single[key]: tensor}
    out: dict[str, Tensor] = {}
    plain = dict(_plain(cfg))
    qkv = {native: kind for kind, native in _qkv_keys(cfg)}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        if key in plain:
            out[pre + plain[key]] = tensor[i]
        elif key in qkv:
            for p, t in zip("qkv", _split_qkv(tensor[i], cfg), strict=True):
                out[f"{pre}self_attn.{p}_proj.{qkv[key]}"] = t
        elif key == _ROUTER:
            out[pre + "mlp.gate.weight"] = tensor[i]
        elif key == _EXP_FC1:
            for e in range(cfg.num_experts):
                gate, up = tensor[i, e].chunk(2, dim=0)
                out[f"{pre}mlp.experts.{e}.gate_proj.weight"], out[f"{pre}mlp.experts.{e}.up_proj.weight"] = gate, up
        elif key == _EXP_FC2:
            for e in range(cfg.num_experts):
                out[f"{pre}mlp.experts.{e}.down_proj.weight"] = tensor[i, e]
        elif key == _FC1:
            out[pre + "mlp.gate_proj.weight"], out[pre + "mlp.up_proj.weight"] = tensor[i].chunk(2, dim=0)
        else:
            raise LoongError(f"a {cfg.family} model has no native tensor {key}")
    return out


def native_to_hf(native: Mapping[str, Tensor], cfg: DenseModelConfig) -> dict[str, Tensor]:
    """Inverse of :func:`hf_to_native`. Returned tensors may be views of ``native``'s tensors."""
    _check_shapes(native, cfg, "Loong model state")
    out: dict[str, Tensor] = {}
    for key in native_shapes(cfg):
        out.update(native_to_hf_key(key, native[key], cfg))
    return out


def families() -> dict[str, HFFamily]:
    """Every supported family, by ``DenseModelConfig.family`` name."""
    from loong.llm.models import deepseek_v3, deepseek_v32, llama, qwen2, qwen3, qwen3_moe

    fams = (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, deepseek_v3.FAMILY, deepseek_v32.FAMILY)
    return {f.name: f for f in fams}


def family_by_name(name: str) -> HFFamily:
    """The declaration of ``DenseModelConfig.family`` ``name``."""
    found = families()
    if name not in found:
        raise LoongError(f"model.family={name!r} is not one of {sorted(found)}")
    return found[name]


def family_for_hf_config(hf_config: dict[str, Any], source: str = "the checkpoint") -> HFFamily:
    """The family of a parsed config.json, from ``architectures`` (or ``model_type`` when that is absent).

    Raises a one-line LoongError naming the checkpoint's architecture for anything unsupported.
    """
    fams = families().values()
    archs = list(hf_config.get("architectures") or [])
    model_type = hf_config.get("model_type")
    for fam in fams:
        if any(a in fam.architectures for a in archs):
            return fam
        if not archs and model_type == fam.model_type:
            return fam
    found = archs[0] if archs else (f"model_type={model_type!r}" if model_type else "unknown-architecture")
    supported = ", ".join(a for fam in fams for a in fam.architectures)
    raise LoongError(f"{source} is a {found} checkpoint; loong-llm supports {supported}")
