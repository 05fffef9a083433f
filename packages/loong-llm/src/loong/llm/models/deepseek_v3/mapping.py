"""Hugging Face <-> Loong tensors for DeepSeek-V3 / V3.2: pure renaming and (gate, up) fusion, dtypes kept.

megatron keys a model with dense and MoE layers per layer (``decoder.layers.{i}.…``, its ``moe_layer_freq``
list makes the layers non-homogeneous), so nothing is stacked. MLA's projections map one to one:
``q_a_proj``/``q_b_proj``/``kv_a_proj_with_mqa``/``kv_b_proj`` are megatron's ``linear_q_down_proj`` /
``linear_q_up_proj`` / ``linear_kv_down_proj`` / ``linear_kv_up_proj`` with the same row order (per head
``[nope, rope]`` queries and ``[k_nope, v]`` latent up-projections). The router's ``e_score_correction_bias``
is megatron's ``expert_bias`` buffer. Multi-token-prediction module ``j`` is HF's ``model.layers.{L + j}`` (as
DeepSeek releases it): ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (megatron's ``final_layernorm``), a
decoder layer, and copies of the embedding and output head (``embed_tokens``, ``shared_head.head``) that megatron
shares with the main model — written on export, dropped (they are the same tensors) on import.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig

Tensor = torch.Tensor

_EMB, _FINAL, _OUT = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"


def _attention_pairs(cfg: DenseModelConfig) -> list[tuple[str, str]]:
    """(native suffix, HF suffix) of one layer's attention and norms."""
    a = "self_attention."
    pairs = [
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        (a + "linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        (a + "kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
        (a + "linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
        (a + "linear_proj.weight", "self_attn.o_proj.weight"),
    ]
    if cfg.q_lora_rank is None:
        pairs.append((a + "linear_q_proj.weight", "self_attn.q_proj.weight"))
    else:
        pairs += [(a + "linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
                  (a + "q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
                  (a + "linear_q_up_proj.weight", "self_attn.q_b_proj.weight")]
    return pairs


def _layers(cfg: DenseModelConfig) -> Iterator[tuple[str, str, bool]]:
    """(native prefix, HF prefix, is MoE) of every decoder layer and MTP module's layer."""
    for i in range(cfg.num_layers):
        yield f"decoder.layers.{i}.", f"model.layers.{i}.", i >= cfg.num_dense_layers
    for j in range(cfg.mtp_num_layers):
        yield f"mtp.layers.{j}.transformer_layer.", f"model.layers.{cfg.num_layers + j}.", cfg.is_moe


_MTP_PAIRS = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
              ("eh_proj.weight", "eh_proj.weight"), ("final_layernorm.weight", "shared_head.norm.weight"))
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def native_shapes(cfg: DenseModelConfig) -> dict[str, tuple[int, ...]]:
    """The whole-tensor shape of every native key of a DeepSeek-V3 / V3.2 ``cfg``."""
    d, v, h = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    c, rope, nope, vd = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    assert c is not None
    attn = {
        "input_layernorm.weight": (d,),
        "pre_mlp_layernorm.weight": (d,),
        "self_attention.linear_kv_down_proj.weight": (c + rope, d),
        "self_attention.kv_layernorm.weight": (c,),
        "self_attention.linear_kv_up_proj.weight": (h * (nope + vd), c),
        "self_attention.linear_proj.weight": (d, h * vd),
    }
    r = cfg.q_lora_rank
    if r is None:
        attn["self_attention.linear_q_proj.weight"] = (h * (nope + rope), d)
    else:
        attn.update({"self_attention.linear_q_down_proj.weight": (r, d), "self_attention.q_layernorm.weight": (r,),
                     "self_attention.linear_q_up_proj.weight": (h * (nope + rope), r)})
    if cfg.is_dsa:
        # V3.2 goes through models/deepseek_v32/mapping.py, which adds the indexer's tensors around this one
        raise LoongError("model.family=deepseek_v32: use loong.llm.models.deepseek_v32.mapping (DeepSeek-V3's "
                         "mapping has no lightning-indexer tensors)")
    f, fe, e = cfg.ffn_hidden_size, cfg.expert_ffn_hidden_size, cfg.num_experts or 0
    dense = {"mlp.linear_fc1.weight": (2 * f, d), "mlp.linear_fc2.weight": (d, f)}
    moe = {"mlp.router.weight": (e, d), "mlp.router.expert_bias": (e,),
           "mlp.experts.experts.linear_fc1.weight": (e, 2 * fe, d), "mlp.experts.experts.linear_fc2.weight": (e, d, fe)}
    if cfg.moe_shared_experts:
        fs = cfg.moe_shared_experts * fe
        moe.update({"mlp.shared_experts.linear_fc1.weight": (2 * fs, d), "mlp.shared_experts.linear_fc2.weight": (d, fs)})
    shapes: dict[str, tuple[int, ...]] = {_EMB: (v, d), _FINAL: (d,), _OUT: (v, d)}
    for native, _, is_moe in _layers(cfg):
        shapes.update({native + k: s for k, s in {**attn, **(moe if is_moe else dense)}.items()})
    for j in range(cfg.mtp_num_layers):
        shapes.update({f"mtp.layers.{j}.{k}": (d,) for k in ("enorm.weight", "hnorm.weight", "final_layernorm.weight")})
        shapes[f"mtp.layers.{j}.eh_proj.weight"] = (d, 2 * d)
    return shapes


def hf_to_native(hf_state: Mapping[str, Tensor], cfg: DenseModelConfig) -> dict[str, Tensor]:
    """HF tensors (``model.layers.{i}…``, MTP modules after the last layer) -> Loong's per-layer native tensors."""
    src = {k: t for k, t in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}

    def take(key: str) -> Tensor:
        if key not in src:
            raise LoongError(f"Hugging Face checkpoint has no tensor {key}")
        return src.pop(key)

    out = {_EMB: take("model.embed_tokens.weight"), _FINAL: take("model.norm.weight"), _OUT: take("lm_head.weight")}
    for native, hf, is_moe in _layers(cfg):
        for n, h in _attention_pairs(cfg):
            out[native + n] = take(hf + h)
        if not is_moe:
            out[native + "mlp.linear_fc1.weight"] = torch.cat([take(hf + "mlp.gate_proj.weight"),
                                                               take(hf + "mlp.up_proj.weight")])
            out[native + "mlp.linear_fc2.weight"] = take(hf + "mlp.down_proj.weight")
            continue
        out[native + "mlp.router.weight"] = take(hf + "mlp.gate.weight")
        out[native + "mlp.router.expert_bias"] = take(hf + "mlp.gate.e_score_correction_bias")
        ex = [f"{hf}mlp.experts.{e}." for e in range(cfg.num_experts or 0)]
        out[native + "mlp.experts.experts.linear_fc1.weight"] = torch.stack(
            [torch.cat([take(p + "gate_proj.weight"), take(p + "up_proj.weight")]) for p in ex])
        out[native + "mlp.experts.experts.linear_fc2.weight"] = torch.stack([take(p + "down_proj.weight") for p in ex])
        if cfg.moe_shared_experts:
            s = hf + "mlp.shared_experts."
            out[native + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([take(s + "gate_proj.weight"),
                                                                              take(s + "up_proj.weight")])
            out[native + "mlp.shared_experts.linear_fc2.weight"] = take(s + "down_proj.weight")
    for j in range(cfg.mtp_num_layers):
        hf = f"model.layers.{cfg.num_layers + j}."
        for n, h in _MTP_PAIRS:
            out[f"mtp.layers.{j}.{n}"] = take(hf + h)
        for h in _MTP_SHARED:  # megatron's MTP uses the main model's embedding and output layer
            src.pop(hf + h, None)
    if src:
        extra = sorted(src)
        raise LoongError(f"Hugging Face checkpoint has {len(extra)} tensors that a {cfg.family} model with this "
                         f"config does not have, e.g. {extra[:3]} (check num_hidden_layers, num_nextn_predict_layers)")
    shapes = native_shapes(cfg)
    for key, t in out.items():
        if tuple(t.shape) != shapes[key]:
            raise LoongError(f"Hugging Face checkpoint: {key} has shape {tuple(t.shape)}, the config implies "
                             f"{shapes[key]}")
    return out


def native_to_hf(native: Mapping[str, Tensor], cfg: DenseModelConfig) -> dict[str, Tensor]:
    """Inverse of :func:`hf_to_native`; MTP modules get their copies of the embedding and output head."""
    for key, shape in native_shapes(cfg).items():
        if key not in native:
            raise LoongError(f"Loong checkpoint: missing {key}")
        if tuple(native[key].shape) != shape:
            raise LoongError(f"Loong checkpoint: {key} has shape {tuple(native[key].shape)}, the config implies {shape}")
    out = {"model.embed_tokens.weight": native[_EMB], "model.norm.weight": native[_FINAL],
           "lm_head.weight": native[_OUT]}
    for nat, hf, is_moe in _layers(cfg):
        for n, h in _attention_pairs(cfg):
            out[hf + h] = native[nat + n]
        if not is_moe:
            out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = native[nat + "mlp.linear_fc1.weight"].chunk(2)
            out[hf + "mlp.down_proj.weight"] = native[nat + "mlp.linear_fc2.weight"]
            continue
        out[hf + "mlp.gate.weight"] = native[nat + "mlp.router.weight"]
        out[hf + "mlp.gate.e_score_correction_bias"] = native[nat + "mlp.router.expert_bias"]
        fc1, fc2 = native[nat + "mlp.experts.experts.linear_fc1.weight"], native[nat + "mlp.experts.experts.linear_fc2.weight"]
        for e in range(cfg.num_experts or 0):
            p = f"{hf}mlp.experts.{e}."
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = fc1[e].chunk(2)
            out[p + "down_proj.weight"] = fc2[e]
        if cfg.moe_shared_experts:
            s = hf + "mlp.shared_experts."
            out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = native[nat + "mlp.shared_experts.linear_fc1.weight"].chunk(2)
            out[s + "down_proj.weight"] = native[nat + "mlp.shared_experts.linear_fc2.weight"]
    for j in range(cfg.mtp_num_layers):
        hf = f"model.layers.{cfg.num_layers + j}."
        for n, h in _MTP_PAIRS:
            out[hf + h] = native[f"mtp.layers.{j}.{n}"]
        out[hf + "embed_tokens.weight"], out[hf + "shared_head.head.weight"] = native[_EMB], native[_OUT]
    return out
