"""Hugging Face <-> Loong for the language side of the Qwen VLMs: tensor keys and the text config.

The text model of ``Qwen2_5_VLForConditionalGeneration`` is a Qwen2 decoder, ``Qwen3VLForConditionalGeneration``'s
a Qwen3 one and ``Qwen3VLMoeForConditionalGeneration``'s a Qwen3-MoE one, so the mapping is loong-llm's
(:func:`loong.llm.models.hf_mapping.hf_to_native` / ``native_to_hf``) behind a key-prefix rename:

- The text tensors live under a prefix, ``model.language_model.`` in memory and in Qwen3-VL files
  (:data:`TEXT_PREFIX`), ``model.`` in Qwen2.5-VL files (:data:`LEGACY_TEXT_PREFIX`: transformers 5 still saves that
  model in the Qwen2-VL layout, vision under ``visual.``), plus ``lm_head.weight`` (absent when tied).
  :func:`text_prefix_of` tells which a state uses; :func:`select_text` takes the text tensors out of a whole state.
- Qwen3-VL-MoE stores each layer's experts fused: ``mlp.experts.gate_up_proj`` (gate rows/columns first, then up)
  and ``mlp.experts.down_proj``. Published checkpoints (transformers 4.57) hold them as ``[E, D, 2F]`` and
  ``[E, F, D]`` (:data:`HUB`); transformers 5 keeps ``[E, 2F, D]`` / ``[E, D, F]`` in memory and writes them that
  way (:data:`TRANSFORMERS5`); it reads either, transposing a tensor whose shape is not the in-memory one. Both
  are read here the same way; they are written in the layout asked for (default :data:`HUB`, which both
  transformers versions read). A tensor whose two layouts have the same shape (``D == 2F``, ``D == F``) is taken
  and written in the in-memory layout, as transformers reads it. Loong's side is loong-llm's ``qwen3_moe`` native
  layout (``mlp.experts.experts.linear_fc1.weight [layers, E, 2F, D]``, ...).

Every mapping is exactly invertible (HF -> Loong -> HF is bit-exact for a state in the layout written).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig
from loong.llm.models.hf_mapping import family_by_name, hf_to_native, native_to_hf, native_to_hf_key

Tensor = torch.Tensor

TEXT_PREFIX = "model.language_model."
LEGACY_TEXT_PREFIX = "model."
LM_HEAD = "lm_head.weight"
HUB: Literal["hub"] = "hub"
TRANSFORMERS5: Literal["transformers5"] = "transformers5"
ExpertsLayout = Literal["hub", "transformers5"]

_FUSED_GATE_UP, _FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
#: a causal-LM checkpoint's per-expert weight (what loong-llm's Qwen3-MoE mapping asks for)
_EXPERT_WEIGHT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")

#: VLM architecture -> (loong-llm family of its text model, interleaved M-RoPE, HF model_type, text model_type)
ARCHITECTURES: dict[str, tuple[str, bool, str, str]] = {
    "Qwen2_5_VLForConditionalGeneration": ("qwen2", False, "qwen2_5_vl", "qwen2_5_vl_text"),
    "Qwen3VLForConditionalGeneration": ("qwen3", True, "qwen3_vl", "qwen3_vl_text"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_moe", True, "qwen3_vl_moe", "qwen3_vl_moe_text"),
}


# --- keys ------------------------------------------------------------------------------------------
def text_prefix_of(keys: Iterable[str]) -> str:
    """:data:`TEXT_PREFIX` or :data:`LEGACY_TEXT_PREFIX`, whichever the text tensors among ``keys`` use."""
    keys = list(keys)
    if any(k.startswith(TEXT_PREFIX) for k in keys):
        return TEXT_PREFIX
    if any(k.startswith(LEGACY_TEXT_PREFIX + "layers.") or k == LEGACY_TEXT_PREFIX + "embed_tokens.weight"
           for k in keys):
        return LEGACY_TEXT_PREFIX
    raise LoongError(f"no text-model tensors (under {TEXT_PREFIX!r} or {LEGACY_TEXT_PREFIX!r}) among "
                     f"{len(keys)} keys, e.g. {sorted(keys)[:3]}")


def _is_text_key(key: str, prefix: str) -> bool:
    if key == LM_HEAD:
        return True
    if not key.startswith(prefix):
        return False
    # under the legacy prefix the vision tower is "visual.", not "model.visual."; refuse either way
    return not key[len(prefix):].startswith(("visual.", "language_model."))


def select_text(hf_state: Mapping[str, Tensor], prefix: str | None = None) -> dict[str, Tensor]:
    """The text-model tensors of a whole VLM state (``prefix``: detected when None)."""
    prefix = prefix or text_prefix_of(hf_state)
    return {k: v for k, v in hf_state.items() if _is_text_key(k, prefix)}


def _fused_layout(t: Tensor, memory: tuple[int, ...], name: str) -> str:
    """Which layout the fused expert tensor ``t`` is in, given its in-memory (transformers 5) shape."""
    hub = (memory[0], memory[2], memory[1])
    if tuple(t.shape) == memory:
        return TRANSFORMERS5  # also when both layouts have this shape: transformers reads it so
    if tuple(t.shape) == hub:
        return HUB
    raise LoongError(f"{name} has shape {tuple(t.shape)}; the config implies {memory} (transformers 5) or {hub} "
                     "(published checkpoints)")


def _expert_shapes(cfg: DenseModelConfig) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_hidden_size
    return (e, 2 * f, d), (e, d, f)


def experts_layout_of(hf_text: Mapping[str, Tensor], cfg: DenseModelConfig, prefix: str = TEXT_PREFIX) -> str:
    """The layout of layer 0's fused ``gate_up_proj`` (:data:`HUB` or :data:`TRANSFORMERS5`), for writing a state
    back the way it came."""
    key = f"{prefix}layers.0.{_FUSED_GATE_UP}"
    if not cfg.is_moe or key not in hf_text:
        raise LoongError(f"no fused experts ({key}) in the state")
    return _fused_layout(hf_text[key], _expert_shapes(cfg)[0], key)


def _unfuse_experts(src: dict[str, Tensor], cfg: DenseModelConfig, prefix: str) -> None:
    """Qwen3-VL-MoE's fused experts in ``src`` -> Qwen3-MoE's per-expert ``[out, in]`` weights, in place."""
    gate_up_shape, down_shape = _expert_shapes(cfg)
    f = cfg.expert_ffn_hidden_size
    for i in range(cfg.num_layers):
        pre = f"{prefix}layers.{i}."
        for fused in (_FUSED_GATE_UP, _FUSED_DOWN):
            if pre + fused not in src:
                raise LoongError(f"Hugging Face checkpoint has no tensor {pre + fused}")
        gate_up, down = src.pop(pre + _FUSED_GATE_UP), src.pop(pre + _FUSED_DOWN)
        if _fused_layout(gate_up, gate_up_shape, pre + _FUSED_GATE_UP) == HUB:
            gate_up = gate_up.transpose(1, 2)
        if _fused_layout(down, down_shape, pre + _FUSED_DOWN) == HUB:
            down = down.transpose(1, 2)
        for e in range(cfg.num_experts):
            src[f"{pre}mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :f]
            src[f"{pre}mlp.experts.{e}.up_proj.weight"] = gate_up[e, f:]
            src[f"{pre}mlp.experts.{e}.down_proj.weight"] = down[e]


def _fuse_experts(out: dict[str, Tensor], cfg: DenseModelConfig, prefix: str, layout: str) -> None:
    """Inverse of :func:`_unfuse_experts`: per-expert weights in ``out`` -> fused tensors in ``layout``. Only the
    fused tensors whose pieces ``out`` holds are made (one native tensor's: gate/up from ``linear_fc1``, down from
    ``linear_fc2``)."""
    gate_up_shape, down_shape = _expert_shapes(cfg)
    for i in range(cfg.num_layers):
        pre = f"{prefix}layers.{i}."
        experts = [f"{pre}mlp.experts.{e}." for e in range(cfg.num_experts)]
        # a tensor whose two layouts share a shape is written as transformers reads it (in-memory layout)
        if experts[0] + "gate_proj.weight" in out:
            gate_up = torch.stack([torch.cat([out.pop(p + "gate_proj.weight"), out.pop(p + "up_proj.weight")])
                                   for p in experts])
            hub = layout == HUB and gate_up_shape[1] != gate_up_shape[2]
            out[pre + _FUSED_GATE_UP] = gate_up.transpose(1, 2) if hub else gate_up
        if experts[0] + "down_proj.weight" in out:
            down = torch.stack([out.pop(p + "down_proj.weight") for p in experts])
            hub = layout == HUB and down_shape[1] != down_shape[2]
            out[pre + _FUSED_DOWN] = down.transpose(1, 2) if hub else down


def _renamed(state: Mapping[str, Tensor], old: str, new: str) -> dict[str, Tensor]:
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in state.items()}


def _fused_moe(cfg: DenseModelConfig) -> bool:
    """Whether the VLM stores this foundation's experts fused (Qwen3-VL-MoE, the only MoE text model here)."""
    return cfg.is_moe and cfg.family == "qwen3_moe"


def text_hf_to_native(hf_text: Mapping[str, Tensor], cfg: DenseModelConfig,
                      prefix: str = TEXT_PREFIX) -> dict[str, Tensor]:
    """A VLM's text-model tensors (``{prefix}...`` and ``lm_head.weight``) -> Loong's native foundation tensors
    (the keys of :func:`loong.core.engines.megatron.state.gather_full_state`). Raises LoongError for missing,
    unexpected (other than the text model's) and misshapen tensors."""
    other = sorted(k for k in hf_text if not _is_text_key(k, prefix))
    if other:
        raise LoongError(f"{len(other)} tensors are not the text model's (under {prefix!r}), e.g. {other[:3]}; "
                         "take the text tensors with select_text()")
    src = dict(hf_text)
    if _fused_moe(cfg):
        _unfuse_experts(src, cfg, prefix)
    try:
        return hf_to_native(_renamed(src, prefix, "model."), cfg)
    except LoongError as err:
        raise LoongError(f"{err} (tensor names as in a causal-LM checkpoint: this VLM's are under {prefix!r})") \
            from None


def text_native_to_hf(native: Mapping[str, Tensor], cfg: DenseModelConfig, prefix: str = TEXT_PREFIX,
                      experts_layout: ExpertsLayout = HUB) -> dict[str, Tensor]:
    """Inverse of :func:`text_hf_to_native`; ``experts_layout`` places Qwen3-VL-MoE's fused experts (module
    docstring). Returned tensors may be views of ``native``'s tensors."""
    if experts_layout not in (HUB, TRANSFORMERS5):
        raise LoongError(f"experts_layout={experts_layout!r}: {HUB!r} or {TRANSFORMERS5!r}")
    out = _renamed(native_to_hf(native, cfg), "model.", prefix)
    if _fused_moe(cfg):
        _fuse_experts(out, cfg, prefix, experts_layout)
    return out


def text_native_to_hf_key(key: str, tensor: Tensor, cfg: DenseModelConfig, prefix: str = TEXT_PREFIX,
                          experts_layout: ExpertsLayout = HUB) -> dict[str, Tensor]:
    """The HF tensors of one native foundation tensor ``key`` (:func:`text_native_to_hf` one key at a time, for a
    converter that streams: Qwen3-VL-MoE's ``linear_fc1`` gives every layer's fused ``gate_up_proj``,
    ``linear_fc2`` its ``down_proj``). They may be views of ``tensor``."""
    out = _renamed(native_to_hf_key(key, tensor, cfg), "model.", prefix)
    if _fused_moe(cfg):
        _fuse_experts(out, cfg, prefix, experts_layout)
    return out


def text_taker(take: Callable[[str], Tensor], cfg: DenseModelConfig,
               prefix: str = TEXT_PREFIX) -> Callable[[str], Tensor]:
    """``take`` for loong-llm's per-key mapping (:func:`loong.llm.models.hf_mapping.hf_to_native_key`, which asks
    for a causal LM's names, ``model.*`` and ``lm_head.weight``) over ``take(name)``, which reads a VLM's text
    tensor by its in-memory name. Qwen3-VL-MoE's per-expert weights are cut from their layer's fused tensor, in
    either layout; the last fused tensor read is kept, since a layer's experts are asked for one after another."""
    gate_up_shape, down_shape = _expert_shapes(cfg) if _fused_moe(cfg) else ((), ())
    last: dict[str, Tensor] = {}

    def text_take(name: str) -> Tensor:
        m = _EXPERT_WEIGHT.fullmatch(name) if _fused_moe(cfg) else None
        if m is None:
            return take(prefix + name[len("model."):] if name.startswith("model.") else name)
        layer, expert, which = m.group(1), int(m.group(2)), m.group(3)
        fused = f"{prefix}layers.{layer}.{_FUSED_DOWN if which == 'down' else _FUSED_GATE_UP}"
        if fused not in last:
            last.clear()
            t = take(fused)
            if _fused_layout(t, down_shape if which == "down" else gate_up_shape, fused) == HUB:
                t = t.transpose(1, 2)
            last[fused] = t
        t = last[fused][expert]
        f = cfg.expert_ffn_hidden_size
        return t if which == "down" else t[:f] if which == "gate" else t[f:]

    return text_take


# --- config ----------------------------------------------------------------------------------------
@dataclass
class VLMTextConfig:
    """A VLM's text model as Loong builds it: the foundation config, its M-RoPE layout (None: 1-D RoPE) and the
    VLM architecture it came from."""

    model: DenseModelConfig
    mrope_section: list[int] | None
    mrope_interleaved: bool
    architecture: str


def architecture_of(hf_config: Mapping[str, Any], source: str = "the checkpoint") -> str:
    """The supported VLM architecture of a parsed config.json (``architectures``, else ``model_type``)."""
    archs = list(hf_config.get("architectures") or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    if not archs:
        for arch, (_, _, model_type, _) in ARCHITECTURES.items():
            if hf_config.get("model_type") == model_type:
                return arch
    found = archs[0] if archs else f"model_type={hf_config.get('model_type')!r}"
    raise LoongError(f"{source} is a {found} checkpoint; the Qwen VLM text mapping supports {', '.join(ARCHITECTURES)}")


def text_config_from_hf(hf_config: Mapping[str, Any], source: str = "the checkpoint") -> VLMTextConfig:
    """The text model of a VLM config.json (its ``text_config``, or the top level in the Qwen2-VL-era flat form).

    ``rope_scaling`` / ``rope_parameters`` carry ``mrope_section`` (and Qwen3-VL's ``mrope_interleaved``); the
    rest is read by the loong-llm family of the text model. ``tie_word_embeddings`` is the top level's when set
    (where transformers ties), else the text config's.
    """
    arch = architecture_of(hf_config, source)
    family_name, interleaved, _, _ = ARCHITECTURES[arch]
    text = dict(hf_config.get("text_config") or hf_config)
    section = None
    for key in ("rope_scaling", "rope_parameters"):
        rope = text.get(key)
        if isinstance(rope, dict):
            rope = dict(rope)
            section = rope.pop("mrope_section", section)
            rope.pop("mrope_interleaved", None)
            if rope.get("type") == "mrope":  # Qwen2-VL-era name of the default rope with sections
                rope["type"] = "default"
            if rope.get("rope_type") == "mrope":
                rope["rope_type"] = "default"
            text[key] = rope
    if "tie_word_embeddings" in hf_config:
        text["tie_word_embeddings"] = hf_config["tie_word_embeddings"]
    family = family_by_name(family_name)
    model = family.config_from_hf(text)
    if family_name == "qwen3_moe":
        model.norm_topk_prob = True  # Qwen3-VL-MoE's router always renormalises the top-k probabilities
    return VLMTextConfig(model=model, mrope_section=None if section is None else [int(n) for n in section],
                         mrope_interleaved=interleaved and section is not None, architecture=arch)


def hf_text_config(text: VLMTextConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The ``text_config`` of a VLM config.json for ``text`` (the inverse of :func:`text_config_from_hf`); the
    writer also puts ``tie_word_embeddings`` at the top level."""
    if text.architecture not in ARCHITECTURES:
        raise LoongError(f"architecture {text.architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    family_name, interleaved, _, text_type = ARCHITECTURES[text.architecture]
    if text.model.family != family_name:
        raise LoongError(f"a {text.architecture}'s text model is model.family={family_name}, not {text.model.family}")
    if text.mrope_interleaved != (interleaved and text.mrope_section is not None):
        raise LoongError(f"{text.architecture} has mrope_interleaved={interleaved}, not {text.mrope_interleaved}")
    out = family_by_name(family_name).hf_config_dict(text.model, dtype)
    out.pop("architectures", None)
    out["model_type"] = text_type
    rope = dict(out["rope_parameters"])
    if text.mrope_section is not None:
        rope["mrope_section"] = list(text.mrope_section)
        if interleaved:
            rope["mrope_interleaved"] = True
    out["rope_parameters"] = rope  # transformers 5
    out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}  # transformers 4.x
    if family_name == "qwen3_moe":
        # Qwen3VLMoeTextConfig has no norm_topk_prob (always on) and names the expert count num_experts
        if not text.model.norm_topk_prob:
            raise LoongError("Qwen3-VL-MoE's router always renormalises the top-k probabilities: "
                             "norm_topk_prob must be true")
        out.pop("norm_topk_prob", None)
    return out


__all__ = [
    "ARCHITECTURES", "HUB", "LEGACY_TEXT_PREFIX", "LM_HEAD", "TEXT_PREFIX", "TRANSFORMERS5", "VLMTextConfig",
    "architecture_of", "experts_layout_of", "hf_text_config", "select_text", "text_config_from_hf",
    "text_hf_to_native", "text_native_to_hf", "text_native_to_hf_key", "text_prefix_of", "text_taker",
]
