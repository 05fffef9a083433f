"""A whole Hugging Face VLM's config.json ⇄ Loong's four configs (``model``, ``encoder``, ``projector``,
``foundation``), declared once per VLM family.

=================  =======================================  ==============  ================  =====================
``model.family``   HF class                                 encoder         projector         foundation
=================  =======================================  ==============  ================  =====================
``qwen2_5_vl``     ``Qwen2_5_VLForConditionalGeneration``   ``qwen2_5_vit`` ``qwen2_5_merger`` ``qwen2``, M-RoPE
``qwen3_vl``       ``Qwen3VLForConditionalGeneration``      ``qwen3_vit``   ``qwen3_merger``  ``qwen3``, interleaved
``qwen3_vl_moe``   ``Qwen3VLMoeForConditionalGeneration``   ``qwen3_vit``   ``qwen3_merger``  ``qwen3_moe``, interl.
``internvl``       ``InternVLForConditionalGeneration``     ``intern_vit``  ``internvl_mlp``  ``llama``/``qwen2``/
                                                                                              ``qwen3``, 1-D RoPE
=================  =======================================  ==============  ================  =====================

The vision side is the family module's (``enc_cfg_from_hf`` / ``proj_cfg_from_hf`` / ``hf_vision_config``), the
Qwen text side :mod:`loong.vlm.models.text_mapping`'s, InternVL's text model loong-llm's own family declaration
(its ``text_config`` is a plain causal LM's). Whether the output layer is tied follows what transformers does
(the top-level ``tie_word_embeddings``, the class default when absent). The placeholder token ids
(``image_token_id``, ``video_token_id``, ``vision_start_token_id``, ...) are written from the processor's
tokenizer, never from a default, so a written folder's config and its processor agree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from loong.core.errors import LoongError
from loong.llm.models.config import TRAINING_FIELDS, DenseModelConfig
from loong.llm.models.hf_mapping import family_by_name, family_for_hf_config
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.families import vision_family
from loong.vlm.models.internvl.vision import tokens_per_tile
from loong.vlm.models.text_mapping import VLMTextConfig, hf_text_config, text_config_from_hf
from loong.vlm.schema import VLMModelConfig

#: fields of each component that a config.json does not hold (how to build, initialise and train it):
#: ``model.init_from_hf`` and an explicit ``train.resume`` take them from the run, the rest from the folder
ENCODER_TRAINING_FIELDS = ("init_std", "init_from", "recompute", "decoupled", "parallel")
PROJECTOR_TRAINING_FIELDS = ("init_std",)
#: ``model`` fields a config.json sets; every other one (freeze, lr_mult, init_from_hf, ...) is the run's
MODEL_HF_FIELDS = ("family", "preset", "mrope_section", "mrope_interleaved")


@dataclass(frozen=True)
class HFVLMFamily:
    """One VLM family's Hugging Face side: its class, model type, components and tying default."""

    name: str
    architecture: str
    model_type: str
    encoder: str
    projector: str
    foundations: tuple[str, ...]
    #: the HF config class's ``tie_word_embeddings`` default (what from_pretrained does when the key is absent)
    tie_default: bool
    #: the processor class that feeds it (``loong.vlm.data.processors.FAMILIES`` key)
    processor: str


FAMILIES: dict[str, HFVLMFamily] = {
    "qwen2_5_vl": HFVLMFamily("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "qwen2_5_vit",
                              "qwen2_5_merger", ("qwen2",), False, "qwen2_5_vl"),
    "qwen3_vl": HFVLMFamily("qwen3_vl", "Qwen3VLForConditionalGeneration", "qwen3_vl", "qwen3_vit", "qwen3_merger",
                            ("qwen3",), False, "qwen3_vl"),
    "qwen3_vl_moe": HFVLMFamily("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", "qwen3_vit",
                                "qwen3_merger", ("qwen3_moe",), False, "qwen3_vl"),
    "internvl": HFVLMFamily("internvl", "InternVLForConditionalGeneration", "internvl", "intern_vit", "internvl_mlp",
                            ("llama", "qwen2", "qwen3"), True, "internvl"),
}


@dataclass
class VLMParts:
    """The four configs that make a VLM (the sections of :class:`~loong.vlm.schema.VLMRunConfig` of that name)."""

    model: VLMModelConfig
    encoder: EncoderConfig
    projector: ProjectorConfig
    foundation: DenseModelConfig

    @classmethod
    def of(cls, cfg: Any) -> VLMParts:
        """The parts of a run config (anything with ``model``, ``encoder``, ``projector``, ``foundation``)."""
        return cls(cfg.model, cfg.encoder, cfg.projector, cfg.foundation)

    def apply_to(self, cfg: Any) -> None:
        """Set ``cfg``'s four sections to these parts."""
        cfg.model, cfg.encoder, cfg.projector, cfg.foundation = self.model, self.encoder, self.projector, \
            self.foundation


def family_spec(name: str, why: str = "a Hugging Face folder") -> HFVLMFamily:
    """The :class:`HFVLMFamily` of ``model.family`` ``name``; ``custom`` (or anything else) is refused, saying
    that ``why`` needs one of the HF families."""
    if name not in FAMILIES:
        raise LoongError(f"model.family={name}: {why} needs a Hugging Face VLM family ({', '.join(FAMILIES)}); a "
                         "custom pairing trains and checkpoints natively only")
    return FAMILIES[name]


def family_of_hf_config(hf_config: dict[str, Any], source: str = "the checkpoint") -> HFVLMFamily:
    """The VLM family of a parsed config.json (``architectures``, else ``model_type``)."""
    archs = list(hf_config.get("architectures") or [])
    for fam in FAMILIES.values():
        if fam.architecture in archs or (not archs and hf_config.get("model_type") == fam.model_type):
            return fam
    found = archs[0] if archs else f"model_type={hf_config.get('model_type')!r}"
    raise LoongError(f"{source} is a {found} checkpoint; loong-vlm reads "
                     f"{', '.join(f.architecture for f in FAMILIES.values())}")


def check_parts(parts: VLMParts, why: str = "a Hugging Face folder") -> HFVLMFamily:
    """Refuse parts that the family's HF class cannot hold (components of another family, M-RoPE where the
    class has none and the reverse); returns the family."""
    fam = family_spec(parts.model.family, why)
    m, want = parts.model, fam.architecture
    if parts.encoder.family != fam.encoder or parts.projector.family != fam.projector:
        raise LoongError(f"model.family={fam.name} ({want}) takes encoder.family={fam.encoder} and projector.family="
                         f"{fam.projector}; got {parts.encoder.family} and {parts.projector.family} (set "
                         "model.family=custom for another pairing)")
    if parts.foundation.family not in fam.foundations:
        raise LoongError(f"model.family={fam.name} ({want}) takes a foundation of family "
                         f"{' or '.join(fam.foundations)}, not {parts.foundation.family} (set model.family=custom "
                         "for another pairing)")
    if fam.name == "internvl" and m.mrope_section is not None:
        raise LoongError(f"model.mrope_section={m.mrope_section}: {want} has 1-D RoPE; set model.mrope_section=null")
    if fam.name != "internvl" and m.mrope_section is None:
        raise LoongError(f"model.mrope_section is null but {want} has M-RoPE; set the three section sizes")
    return fam


# --- reading -----------------------------------------------------------------------------------------
def _tie(hf_config: dict[str, Any], fam: HFVLMFamily) -> bool:
    tie = bool(hf_config.get("tie_word_embeddings", fam.tie_default))
    if fam.name == "qwen2_5_vl":  # Qwen2_5_VLConfig: a text_config tie from before transformers 5 ties too
        tie = tie or bool((hf_config.get("text_config") or {}).get("tie_word_embeddings", False))
    return tie


def _keep(target: Any, run: Any, names: tuple[str, ...]) -> None:
    for name in names:
        setattr(target, name, getattr(run, name))


def _model_training_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(VLMModelConfig) if f.name not in MODEL_HF_FIELDS)


def parts_from_hf(hf_config: dict[str, Any], source: str = "the checkpoint", keep: VLMParts | None = None,
                  preset: str = "custom") -> VLMParts:
    """The four configs of a parsed config.json. ``keep`` (the run's parts) donates the fields a config.json does
    not hold (:data:`ENCODER_TRAINING_FIELDS`, :data:`PROJECTOR_TRAINING_FIELDS`, loong-llm's
    ``TRAINING_FIELDS``, every ``model`` field but :data:`MODEL_HF_FIELDS`); ``preset`` names the
    result (e.g. the folder's name)."""
    fam = family_of_hf_config(hf_config, source)
    vision = dict(hf_config.get("vision_config") or {})
    if not vision:
        raise LoongError(f"{source}: config.json has no vision_config")
    module = vision_family(fam.encoder, fam.projector).load()
    enc = module.enc_cfg_from_hf(vision)
    if fam.name == "internvl":
        proj = module.proj_cfg_from_hf(hf_config)
        text = dict(hf_config.get("text_config") or {})
        if not text:
            raise LoongError(f"{source}: config.json has no text_config")
        try:
            text_family = family_for_hf_config(text, source=f"{source} (text_config)")
        except LoongError as err:
            raise LoongError(f"{err}; {fam.architecture} here takes a {'/'.join(fam.foundations)} text model") \
                from None
        if text_family.name not in fam.foundations:
            raise LoongError(f"{source}: {fam.architecture} with a {text_family.name} text model is not supported "
                             f"(text models: {', '.join(fam.foundations)})")
        foundation = text_family.config_from_hf(text)
        seq = hf_config.get("image_seq_length")
        if seq is not None and int(seq) != tokens_per_tile(enc, proj):
            raise LoongError(f"{source}: image_seq_length={seq} but the vision config gives "
                             f"{tokens_per_tile(enc, proj)} tokens a tile")
        section, interleaved = None, False
    else:
        proj = module.proj_cfg_from_hf(vision)
        if fam.name == "qwen2_5_vl":  # Qwen2_5_VLVisionConfig's default when absent
            enc.tokens_per_second = float(vision.get("tokens_per_second", 4))
        parsed = text_config_from_hf(hf_config, source)
        foundation, section, interleaved = parsed.model, parsed.mrope_section, parsed.mrope_interleaved
        if section is None:
            raise LoongError(f"{source}: {fam.architecture}'s text config has no mrope_section")
    foundation.tie_word_embeddings = _tie(hf_config, fam)
    model = VLMModelConfig(family=fam.name, preset=preset, mrope_section=section, mrope_interleaved=interleaved)
    enc.preset = preset
    foundation.preset = preset
    if keep is not None:
        _keep(model, keep.model, _model_training_fields())
        _keep(enc, keep.encoder, ENCODER_TRAINING_FIELDS)
        _keep(proj, keep.projector, PROJECTOR_TRAINING_FIELDS)
        _keep(foundation, keep.foundation, TRAINING_FIELDS)
    parts = VLMParts(model, enc, proj, foundation)
    check_parts(parts)
    return parts


def adopt_parts(cfg: Any, donor: VLMParts) -> None:
    """Set ``cfg``'s four sections to ``donor``'s shapes, keeping ``cfg``'s training fields (what an explicit
    ``train.resume`` of a converted checkpoint does, as ``model.init_from_hf`` does with a folder)."""
    run = VLMParts.of(cfg)
    parts = VLMParts(*(dataclasses.replace(p) for p in (donor.model, donor.encoder, donor.projector,
                                                        donor.foundation)))
    _keep(parts.model, run.model, _model_training_fields())
    _keep(parts.encoder, run.encoder, ENCODER_TRAINING_FIELDS)
    _keep(parts.projector, run.projector, PROJECTOR_TRAINING_FIELDS)
    _keep(parts.foundation, run.foundation, TRAINING_FIELDS)
    parts.apply_to(cfg)


# --- writing -----------------------------------------------------------------------------------------
def _hf_processor(processor: Any) -> Any:
    """The transformers processor of a :class:`~loong.vlm.data.processors.VisionProcessor` or of itself."""
    return getattr(processor, "hf", processor)


def _token_id(tokenizer: Any, token: str, what: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tokenizer.convert_ids_to_tokens(int(tid)) != token:
        raise LoongError(f"the processor's tokenizer has no {what} token {token!r}")
    return int(tid)


def processor_token_ids(parts: VLMParts, processor: Any) -> dict[str, int]:
    """The config.json placeholder token ids of ``parts``' family, read from ``processor``'s tokenizer."""
    fam = family_spec(parts.model.family, "writing a Hugging Face config")
    hf = _hf_processor(processor)
    tok = getattr(hf, "tokenizer", None)
    if tok is None:
        raise LoongError(f"{type(hf).__name__} is not a processor with a tokenizer")
    if fam.name == "internvl":
        ids = {"image_token_id": _token_id(tok, hf.image_token, "image context")}
    else:
        ids = {"image_token_id": _token_id(tok, hf.image_token, "image"),
               "video_token_id": _token_id(tok, hf.video_token, "video")}
        for name, default in (("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>")):
            token = getattr(hf, f"{name}_token", None) or getattr(tok, f"{name}_token", None) or default
            ids[f"{name}_token_id"] = _token_id(tok, token, name.replace("_", " "))
    big = {k: v for k, v in ids.items() if v >= parts.foundation.vocab_size}
    if big:
        raise LoongError(f"the processor's token ids {big} are outside foundation.vocab_size="
                         f"{parts.foundation.vocab_size}")
    return ids


def check_processor(parts: VLMParts, processor: Any) -> None:
    """Refuse a processor that does not feed ``parts`` (another family, another patch geometry, a vocabulary
    larger than the foundation's)."""
    from loong.vlm.data.processors import FAMILIES as PROCESSORS

    fam = family_spec(parts.model.family, "writing a Hugging Face folder")
    hf = _hf_processor(processor)
    want = PROCESSORS[fam.processor]
    if type(hf).__name__ != want:
        raise LoongError(f"a {fam.architecture} folder takes a processor of class {want}, not {type(hf).__name__}")
    enc = parts.encoder
    if fam.name == "internvl":
        seq = tokens_per_tile(enc, parts.projector)
        size = hf.image_processor.size
        if int(hf.image_seq_length) != seq or (int(size.height), int(size.width)) != (enc.image_size,) * 2:
            raise LoongError(f"the processor makes tiles of {size.height}x{size.width} px with "
                             f"{hf.image_seq_length} tokens; the model takes {enc.image_size} px tiles of {seq}")
    else:
        for name, sub in (("image", hf.image_processor), ("video", hf.video_processor)):
            got = (int(sub.patch_size), int(sub.merge_size), int(sub.temporal_patch_size))
            model = (enc.patch_size, enc.spatial_merge_size, enc.temporal_patch_size)
            if got != model:
                raise LoongError(f"the processor's {name} patches (patch, merge, temporal) = {got}; the encoder "
                                 f"takes {model}")
    if len(hf.tokenizer) > parts.foundation.vocab_size:
        raise LoongError(f"the processor's tokenizer has {len(hf.tokenizer)} tokens but foundation.vocab_size is "
                         f"{parts.foundation.vocab_size}")


def _special_ids(text: dict[str, Any], processor: Any, vocab_size: int) -> None:
    """bos / eos / pad ids from the tokenizer where the text config has none or one outside the vocabulary (a
    config class's default that does not belong to this tokenizer)."""
    tok = _hf_processor(processor).tokenizer

    def valid(value: Any) -> bool:
        values = value if isinstance(value, list) else [value]
        return bool(values) and all(isinstance(v, int) and 0 <= v < vocab_size for v in values)

    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if not valid(text.get(name)):
            text[name] = getattr(tok, name, None)


def hf_config_of(parts: VLMParts, processor: Any, dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json of ``parts`` (the inverse of :func:`parts_from_hf`), token ids from ``processor``."""
    fam = check_parts(parts, "writing a Hugging Face config")
    check_processor(parts, processor)
    enc, proj, fnd, m = parts.encoder, parts.projector, parts.foundation, parts.model
    if proj.out_hidden_size != fnd.hidden_size:
        raise LoongError(f"projector.out_hidden_size={proj.out_hidden_size} must equal foundation.hidden_size="
                         f"{fnd.hidden_size}")
    module = vision_family(fam.encoder, fam.projector).load()
    out: dict[str, Any] = {"architectures": [fam.architecture], "model_type": fam.model_type}
    if fam.name == "internvl":
        text = family_by_name(fnd.family).hf_config_dict(fnd, dtype)
        out["vision_config"] = module.hf_vision_config(enc, proj)
        out.update(module.hf_projector_config(proj, enc))
    else:
        text = hf_text_config(VLMTextConfig(fnd, list(m.mrope_section), m.mrope_interleaved, fam.architecture),
                              dtype)
        if fam.name == "qwen3_vl_moe":
            vision = module.hf_vision_config(enc, proj, moe=True)
        else:
            vision = module.hf_vision_config(enc, proj)
        if fam.name == "qwen2_5_vl":
            tps = enc.tokens_per_second
            vision["tokens_per_second"] = int(tps) if float(tps).is_integer() else tps
        out["vision_config"] = vision
    _special_ids(text, processor, fnd.vocab_size)
    out["text_config"] = text
    out.update(processor_token_ids(parts, processor))
    out.update(tie_word_embeddings=fnd.tie_word_embeddings, dtype=dtype, torch_dtype=dtype)
    return out


def generation_config_of(hf_config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json of a VLM config: the text model's bos / eos / pad ids."""
    text = hf_config.get("text_config") or hf_config
    out: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if text.get(key) is not None:
            out[key] = text[key]
    return out


__all__ = ["ENCODER_TRAINING_FIELDS", "FAMILIES", "MODEL_HF_FIELDS", "PROJECTOR_TRAINING_FIELDS", "HFVLMFamily",
           "VLMParts", "adopt_parts", "check_parts", "check_processor", "family_of_hf_config", "family_spec",
           "generation_config_of", "hf_config_of", "parts_from_hf", "processor_token_ids"]
