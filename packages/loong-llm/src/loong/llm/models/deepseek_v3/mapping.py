"""Hugging Face <-> Loong tensors for DeepSeek-V3 / V3.2, one native tensor at a time: pure renaming, (gate, up)
fusion and expert stacking, dtypes kept.

megatron keys a model with dense and MoE layers per layer (``decoder.layers.{i}.…``, its ``moe_layer_freq``
list makes the layers non-homogeneous), so nothing is stacked over layers. MLA's projections map one to one:
``q_a_proj``/``q_b_proj``/``kv_a_proj_with_mqa``/``kv_b_proj`` are megatron's ``linear_q_down_proj`` /
``linear_q_up_proj`` / ``linear_kv_down_proj`` / ``linear_kv_up_proj`` with the same row order (per head
``[nope, rope]`` queries and ``[k_nope, v]`` latent up-projections). The router's ``e_score_correction_bias``
is megatron's ``expert_bias`` buffer; a MoE layer's routed experts are one native tensor per projection,
``[experts, …]`` (fc1 rows ``cat(gate, up)``). Multi-token-prediction module ``j`` is HF's ``model.layers.{L + j}``
(as DeepSeek releases it): ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (megatron's
``final_layernorm``), a decoder layer, and copies of the embedding and output head (``embed_tokens``,
``shared_head.head``) that megatron shares with the main model — written on export, not read (they are the same
tensors) on import. DeepSeek-V3.2 adds each layer's lightning indexer (:mod:`..deepseek_v32.mapping`).

The mapping is declared once, as a :data:`Rule` per native key (its shape, how its HF tensors combine, their
names); :func:`hf_to_native_key` and :func:`native_to_hf_key` both follow it, so a converter can hold one native
tensor at a time. The whole-state-dict functions are ``loong.llm.models.hf_mapping``'s, key by key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig

Tensor = torch.Tensor

_EMB, _FINAL, _OUT = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"
# How a native tensor's HF tensors combine: one tensor; the same tensor under several names (the MTP copies: the
# first is read on import, every one written on export); cat(gate, up); per expert cat(gate, up), stacked; stacked.
ONE, COPIES, GATE_UP, EXPERTS_GATE_UP, EXPERTS = "one", "copies", "gate_up", "experts_gate_up", "experts"
Rule = tuple[tuple[int, ...], str, tuple[str, ...]]
"""(the native tensor's shape, how its HF tensors combine, their names in order)."""

_MTP_PAIRS = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
              ("eh_proj.weight", "eh_proj.weight"), ("final_layernorm.weight", "shared_head.norm.weight"))
_LAYER_KEY = re.compile(r"(decoder\.layers\.(\d+)\.|mtp\.layers\.(\d+)\.transformer_layer\.)(.+)")
_MTP_KEY = re.compile(r"mtp\.layers\.(\d+)\.(.+)")


def _layer_rules(cfg: DenseModelConfig, is_moe: bool) -> dict[str, Rule]:
    """native suffix -> rule (HF suffixes) of one decoder layer: attention and norms, its MLP, V3.2's indexer."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    c, rope, nope, vd = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    assert c is not None
    a, sa = "self_attention.", "self_attn."
    rules: dict[str, Rule] = {
        "input_layernorm.weight": ((d,), ONE, ("input_layernorm.weight",)),
        "pre_mlp_layernorm.weight": ((d,), ONE, ("post_attention_layernorm.weight",)),
        a + "linear_kv_down_proj.weight": ((c + rope, d), ONE, (sa + "kv_a_proj_with_mqa.weight",)),
        a + "kv_layernorm.weight": ((c,), ONE, (sa + "kv_a_layernorm.weight",)),
        a + "linear_kv_up_proj.weight": ((h * (nope + vd), c), ONE, (sa + "kv_b_proj.weight",)),
        a + "linear_proj.weight": ((d, h * vd), ONE, (sa + "o_proj.weight",)),
    }
    r = cfg.q_lora_rank
    if r is None:
        rules[a + "linear_q_proj.weight"] = ((h * (nope + rope), d), ONE, (sa + "q_proj.weight",))
    else:
        rules.update({a + "linear_q_down_proj.weight": ((r, d), ONE, (sa + "q_a_proj.weight",)),
                      a + "q_layernorm.weight": ((r,), ONE, (sa + "q_a_layernorm.weight",)),
                      a + "linear_q_up_proj.weight": ((h * (nope + rope), r), ONE, (sa + "q_b_proj.weight",))})
    if cfg.is_dsa:
        from loong.llm.models.deepseek_v32.mapping import indexer_rules

        rules.update(indexer_rules(cfg))
    gate_up = ("gate_proj.weight", "up_proj.weight")
    if not is_moe:
        f = cfg.ffn_hidden_size
        rules.update({"mlp.linear_fc1.weight": ((2 * f, d), GATE_UP, tuple("mlp." + p for p in gate_up)),
                      "mlp.linear_fc2.weight": ((d, f), ONE, ("mlp.down_proj.weight",))})
        return rules
    fe, e = cfg.expert_ffn_hidden_size, cfg.num_experts or 0
    ex = [f"mlp.experts.{i}." for i in range(e)]
    rules.update({
        "mlp.router.weight": ((e, d), ONE, ("mlp.gate.weight",)),
        "mlp.router.expert_bias": ((e,), ONE, ("mlp.gate.e_score_correction_bias",)),
        "mlp.experts.experts.linear_fc1.weight": ((e, 2 * fe, d), EXPERTS_GATE_UP,
                                                  tuple(p + s for p in ex for s in gate_up)),
        "mlp.experts.experts.linear_fc2.weight": ((e, d, fe), EXPERTS, tuple(p + "down_proj.weight" for p in ex)),
    })
    if cfg.moe_shared_experts:
        fs = cfg.moe_shared_experts * fe
        rules.update({
            "mlp.shared_experts.linear_fc1.weight": ((2 * fs, d), GATE_UP,
                                                     tuple("mlp.shared_experts." + p for p in gate_up)),
            "mlp.shared_experts.linear_fc2.weight": ((d, fs), ONE, ("mlp.shared_experts.down_proj.weight",)),
        })
    return rules


def _layers(cfg: DenseModelConfig) -> Iterator[tuple[str, str, bool]]:
    """(native prefix, HF prefix, is MoE) of every decoder layer and MTP module's layer."""
    for i in range(cfg.num_layers):
        yield f"decoder.layers.{i}.", f"model.layers.{i}.", i >= cfg.num_dense_layers
    for j in range(cfg.mtp_num_layers):
        yield f"mtp.layers.{j}.transformer_layer.", f"model.layers.{cfg.num_layers + j}.", cfg.is_moe


def _top_rules(cfg: DenseModelConfig) -> dict[str, Rule]:
    """The embedding, final norm and output head (with the MTP modules' copies of the embedding and head)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    mtp = [f"model.layers.{cfg.num_layers + j}." for j in range(cfg.mtp_num_layers)]
    return {_EMB: ((v, d), COPIES, ("model.embed_tokens.weight", *(p + "embed_tokens.weight" for p in mtp))),
            _FINAL: ((d,), ONE, ("model.norm.weight",)),
            _OUT: ((v, d), COPIES, ("lm_head.weight", *(p + "shared_head.head.weight" for p in mtp)))}


def _mtp_rules(cfg: DenseModelConfig, j: int) -> dict[str, Rule]:
    """MTP module ``j``'s own tensors (its decoder layer is one of :func:`_layers`)."""
    d, hf = cfg.hidden_size, f"model.layers.{cfg.num_layers + j}."
    shapes = {"enorm.weight": (d,), "hnorm.weight": (d,), "eh_proj.weight": (d, 2 * d), "final_layernorm.weight": (d,)}
    return {f"mtp.layers.{j}.{n}": (shapes[n], ONE, (hf + h,)) for n, h in _MTP_PAIRS}


def rules(cfg: DenseModelConfig) -> dict[str, Rule]:
    """Every native key's rule, in checkpoint order."""
    out = _top_rules(cfg)
    for native, hf, is_moe in _layers(cfg):
        out.update({native + k: (s, how, tuple(hf + n for n in names))
                    for k, (s, how, names) in _layer_rules(cfg, is_moe).items()})
    for j in range(cfg.mtp_num_layers):
        out.update(_mtp_rules(cfg, j))
    return out


def rule(key: str, cfg: DenseModelConfig) -> Rule:
    """The rule of one native key, without building every key's (a converter asks once per key)."""
    top = _top_rules(cfg)
    if key in top:
        return top[key]
    m = _LAYER_KEY.fullmatch(key)
    # decoder layer i < L, or MTP module j < mtp (HF's layer L + j)
    if m and (int(m[2]) < cfg.num_layers if m[2] is not None else int(m[3]) < cfg.mtp_num_layers):
        decoder = m[2] is not None
        i = int(m[2]) if decoder else cfg.num_layers + int(m[3])
        layer = _layer_rules(cfg, i >= cfg.num_dense_layers if decoder else cfg.is_moe)
        if m[4] in layer:
            s, how, names = layer[m[4]]
            return s, how, tuple(f"model.layers.{i}.{n}" for n in names)
    m = _MTP_KEY.fullmatch(key)
    if m and int(m[1]) < cfg.mtp_num_layers:
        own = _mtp_rules(cfg, int(m[1]))
        if key in own:
            return own[key]
    raise LoongError(f"a {cfg.family} model with this config has no native tensor {key}")


def native_shapes(cfg: DenseModelConfig) -> dict[str, tuple[int, ...]]:
    """The whole-tensor shape of every native key of a DeepSeek-V3 / V3.2 ``cfg``."""
    return {key: shape for key, (shape, _, _) in rules(cfg).items()}


def hf_aliases(cfg: DenseModelConfig) -> set[str]:
    """HF tensors that are copies of another (the MTP modules' embedding and head): allowed, never read."""
    return {n for _, how, names in _top_rules(cfg).values() if how == COPIES for n in names[1:]}


def hf_to_native_key(key: str, take: Callable[[str], Tensor], cfg: DenseModelConfig) -> Tensor:
    """The native tensor ``key`` built from the HF tensors ``take(name)`` returns (only its own are asked for)."""
    _, how, names = rule(key, cfg)
    parts = [take(n) for n in (names[:1] if how == COPIES else names)]
    try:
        if how in (ONE, COPIES):
            return parts[0]
        if how == GATE_UP:
            return torch.cat(parts)
        if how == EXPERTS:
            return torch.stack(parts)
        return torch.stack([torch.cat(parts[e:e + 2]) for e in range(0, len(parts), 2)])
    except RuntimeError:  # torch's own message names no tensor
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, parts, strict=True))
        raise LoongError(f"Hugging Face tensors of {key} do not fit together: {shapes}") from None


def native_to_hf_key(key: str, tensor: Tensor, cfg: DenseModelConfig) -> dict[str, Tensor]:
    """The HF tensors of one native tensor (views of ``tensor``); the inverse of :func:`hf_to_native_key`."""
    shape, how, names = rule(key, cfg)
    if tuple(tensor.shape) != shape:
        raise LoongError(f"Loong checkpoint: {key} has shape {tuple(tensor.shape)}, the config implies {shape}")
    if how in (ONE, COPIES):
        return dict.fromkeys(names, tensor)
    if how == GATE_UP:
        return dict(zip(names, tensor.chunk(2), strict=True))
    if how == EXPERTS:
        return dict(zip(names, tensor.unbind(0), strict=True))
    halves = [h for e in tensor.unbind(0) for h in e.chunk(2)]
    return dict(zip(names, halves, strict=True))
