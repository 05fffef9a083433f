"""Pi0.5 <-> lerobot 0.6.1 ``PI05Policy``: the state-dict names and the config fields, declared once.

Weights: Loong's parameter names follow transformers' Gemma inside each module, so the mapping is a table of
prefixes (:data:`PREFIXES`; ``layers.{i}.vlm`` / ``layers.{i}.expert`` are the two halves of lerobot's
``language_model.layers.{i}`` / ``gemma_expert.model.layers.{i}``). lerobot's module also holds two vocabulary-
sized matrices Pi0.5 never reads: PaliGemma's LM head (openpi ties it to the embedding; lerobot's
``from_pretrained`` uses it as the embedding when a file has no embedding) and the action expert's LM head. :func:`to_lerobot` writes the
first as the embedding and the second as zeros (``from_pretrained`` loads strictly); :func:`from_lerobot` drops both,
and :func:`fix_checkpoint` applies ``from_pretrained``'s own key fixes to a saved lerobot checkpoint first.

Config: lerobot names Gemma sizes by variant (``get_gemma_config``: ``gemma_2b`` / ``gemma_300m``) and hard-codes
SigLIP so400m, 8 query heads and the 257152-token vocabulary, so only Loong configs of those shapes export
(``check_vision=False`` skips the SigLIP check for oracles built with shrunk towers, as the tests do).
Freezing: ``tune_visual=False`` is lerobot's ``freeze_vision_encoder``; ``tune_llm=False`` together with
``tune_visual=False`` is ``train_expert_only``; lerobot cannot freeze the language model alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from loong.core.errors import LoongError
from loong.embodied.policies.pi05.config import Pi05Config

if TYPE_CHECKING:
    from loong.embodied.policies.pi05.processor import Pi05Processor

#: lerobot's policy type (``config.json``'s ``"type"``)
LEROBOT_TYPE = "pi05"

_PG = "model.paligemma_with_expert.paligemma.model."
_EXPERT = "model.paligemma_with_expert.gemma_expert.model."
#: Loong name prefix -> lerobot name prefix (``{i}``: the layer index)
PREFIXES: tuple[tuple[str, str], ...] = (
    ("vision_tower.", _PG + "vision_tower."),
    ("projector.", _PG + "multi_modal_projector.linear."),
    ("embed_tokens.", _PG + "language_model.embed_tokens."),
    ("layers.{i}.vlm.", _PG + "language_model.layers.{i}."),
    ("layers.{i}.expert.", _EXPERT + "layers.{i}."),
    ("vlm_norm.", _PG + "language_model.norm."),
    ("expert_norm.", _EXPERT + "norm."),
    ("action_in_proj.", "model.action_in_proj."),
    ("action_out_proj.", "model.action_out_proj."),
    ("time_mlp_in.", "model.time_mlp_in."),
    ("time_mlp_out.", "model.time_mlp_out."),
)
PALIGEMMA_LM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"
EXPERT_LM_HEAD = "model.paligemma_with_expert.gemma_expert.lm_head.weight"
UNUSED_KEYS = (PALIGEMMA_LM_HEAD, EXPERT_LM_HEAD)
#: the Loong tensors :func:`to_lerobot` computes lerobot tensors from (the two LM heads), besides renaming: a
#: streamed export (``lerobot_io.MappedWeights``) reads only these to compute them
DERIVED_FROM = ("embed_tokens.weight",)
#: the same for :func:`fix_checkpoint` (the embedding of an openpi checkpoint that has only the tied LM head)
FIX_DERIVED_FROM = (PALIGEMMA_LM_HEAD, PALIGEMMA_LM_HEAD.removeprefix("model."))

#: SigLIP so400m/14 as lerobot builds it (PaliGemma's default vision config plus lerobot's overrides)
LEROBOT_VISION = {"vision_width": 1152, "vision_depth": 27, "vision_mlp_dim": 4304, "vision_num_heads": 16,
                  "patch_size": 14}
LEROBOT_VOCAB = 257152
LEROBOT_NUM_HEADS = 8  # modeling_pi05 reshapes the joint attention output to 8 * head_dim


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(\d+)"))


_TO_LEROBOT = [(_compile(loong), lerobot) for loong, lerobot in PREFIXES]
_FROM_LEROBOT = [(_compile(lerobot), loong) for loong, lerobot in PREFIXES]


def _rename(name: str, rules: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, target in rules:
        match = pattern.match(name)
        if match:
            head = target.replace("{i}", match.group(1)) if match.groups() else target
            return head + name[match.end():]
    return None


def to_lerobot_name(name: str) -> str:
    """The lerobot name of Loong parameter ``name``."""
    out = _rename(name, _TO_LEROBOT)
    if out is None:
        raise LoongError(f"pi05 -> lerobot: no lerobot name for parameter '{name}'")
    return out


def from_lerobot_name(name: str) -> str:
    """The Loong name of lerobot parameter ``name``."""
    out = _rename(name, _FROM_LEROBOT)
    if out is None:
        raise LoongError(f"lerobot -> pi05: no Loong name for lerobot parameter '{name}'")
    return out


def _variant(config: Pi05Config, width: int, mlp_dim: int, role: str) -> str:
    """The lerobot Gemma variant whose ``get_gemma_config`` sizes equal Loong's (looked up at call time, so what
    lerobot would build decides)."""
    from lerobot.policies.pi05 import modeling_pi05

    want = (width, config.vlm_depth, mlp_dim, config.num_heads, config.num_kv_heads, config.head_dim)
    for variant in ("gemma_2b", "gemma_300m"):
        g = modeling_pi05.get_gemma_config(variant)
        if (g.width, g.depth, g.mlp_dim, g.num_heads, g.num_kv_heads, g.head_dim) == want:
            return variant
    raise LoongError(f"pi05 -> lerobot: the {role} (width {width}, depth {config.vlm_depth}, mlp {mlp_dim}, heads "
                     f"{config.num_heads}/{config.num_kv_heads}x{config.head_dim}) is no lerobot Gemma variant "
                     "(gemma_2b: 2048/18/16384, gemma_300m: 1024/18/4096, both 8/1x256)")


def to_lerobot(config: Pi05Config, state_dict: Mapping[str, torch.Tensor], processor: Pi05Processor | None = None,
               *, check_vision: bool = True) -> tuple[Any, dict[str, torch.Tensor]]:
    """lerobot's ``PI05Config`` and ``PI05Policy`` state dict of a Loong Pi0.5 (``processor`` gives the input and
    output features, in its camera order; without it the config has none)."""
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    if config.vocab_size != LEROBOT_VOCAB or config.num_heads != LEROBOT_NUM_HEADS:
        raise LoongError(f"pi05 -> lerobot: lerobot fixes vocab_size {LEROBOT_VOCAB} and num_heads "
                         f"{LEROBOT_NUM_HEADS}; this config has {config.vocab_size} and {config.num_heads}")
    if check_vision:
        wrong = {k: getattr(config, k) for k, v in LEROBOT_VISION.items() if getattr(config, k) != v}
        if wrong:
            raise LoongError(f"pi05 -> lerobot: lerobot builds SigLIP so400m/14 ({LEROBOT_VISION}); this config has "
                             f"{wrong}")
    vlm_variant = _variant(config, config.vlm_width, config.vlm_mlp_dim, "VLM")
    expert_variant = _variant(config, config.expert_width, config.expert_mlp_dim, "action expert")
    inputs: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    if processor is not None:
        for key in processor.camera_keys:
            shape = list(processor.features[key]["shape"])
            names = processor.features[key].get("names") or ["height", "width", "channels"]
            chw = (shape[2], shape[0], shape[1]) if names[2] in ("channel", "channels") else tuple(shape)
            inputs[key] = PolicyFeature(FeatureType.VISUAL, tuple(int(s) for s in chw))
        inputs[processor.state_key] = PolicyFeature(FeatureType.STATE, (processor.state_dim,))
        outputs[processor.action_key] = PolicyFeature(FeatureType.ACTION, (processor.action_dim,))
    lerobot_config = PI05Config(
        paligemma_variant=vlm_variant, action_expert_variant=expert_variant, dtype="float32",
        chunk_size=config.chunk_size, n_action_steps=config.n_action_steps, max_state_dim=config.max_state_dim,
        max_action_dim=config.max_action_dim, num_inference_steps=config.num_inference_steps,
        time_sampling_beta_alpha=config.time_sampling_beta_alpha,
        time_sampling_beta_beta=config.time_sampling_beta_beta, time_sampling_scale=config.time_sampling_scale,
        time_sampling_offset=config.time_sampling_offset, min_period=config.min_period,
        max_period=config.max_period, image_resolution=(config.image_size, config.image_size),
        empty_cameras=config.empty_cameras, tokenizer_max_length=config.tokenizer_max_length,
        freeze_vision_encoder=not config.tune_visual, train_expert_only=not config.tune_llm and not config.tune_visual,
        input_features=inputs, output_features=outputs)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        out[to_lerobot_name(name)] = tensor
    embed = state_dict["embed_tokens.weight"]
    out[PALIGEMMA_LM_HEAD] = embed.clone()
    out[EXPERT_LM_HEAD] = torch.zeros(config.vocab_size, config.expert_width, dtype=embed.dtype, device=embed.device)
    return lerobot_config, out


def fix_checkpoint(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A saved lerobot Pi0.5 checkpoint as ``PI05Policy.from_pretrained`` reads it: ``model.`` prefixed,
    openpi's ``action_time_mlp_*`` named ``time_mlp_*``, ``state_proj`` (Pi0 only) dropped, and PaliGemma's LM
    head taken as the embedding where the file has a head but no embedding (openpi's tied checkpoints)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = name if name.startswith("model.") else f"model.{name}"
        key = key.replace("model.action_time_mlp_", "model.time_mlp_")
        if key.startswith("model.state_proj."):
            continue
        out[key] = tensor
    embed = _PG + "language_model.embed_tokens.weight"
    if PALIGEMMA_LM_HEAD in out and embed not in out:
        # lerobot writes the LM head into the embedding first and the file's embedding (a later key in a
        # safetensors file, whose keys are sorted) over it: the head only counts when the file has no embedding
        out[embed] = out[PALIGEMMA_LM_HEAD].clone()
    return out


def from_lerobot(lerobot_config: Any, lerobot_state_dict: Mapping[str, torch.Tensor],
                 **overrides: Any) -> tuple[Pi05Config, dict[str, torch.Tensor]]:
    """The Loong config and state dict of a lerobot ``PI05Policy``'s config and state dict.

    Sizes are read off the weights (lerobot's fixed 8 query heads give ``head_dim``); SigLIP's head count is not
    in the weights and is so400m's 16 unless ``overrides`` say otherwise (as every other field can)."""
    sd = {k: v for k, v in lerobot_state_dict.items() if k not in UNUSED_KEYS}
    state_dict = {from_lerobot_name(k): v for k, v in sd.items()}
    try:
        patch = state_dict["vision_tower.embeddings.patch_embedding.weight"]
        embed = state_dict["embed_tokens.weight"]
        q = state_dict["layers.0.vlm.self_attn.q_proj.weight"]
        k = state_dict["layers.0.vlm.self_attn.k_proj.weight"]
        sizes = dict(
            patch_size=int(patch.shape[-1]), vision_width=int(patch.shape[0]),
            vision_depth=len({n.split(".")[3] for n in state_dict if n.startswith("vision_tower.encoder.layers.")}),
            vision_mlp_dim=int(state_dict["vision_tower.encoder.layers.0.mlp.fc1.weight"].shape[0]),
            vision_num_heads=LEROBOT_VISION["vision_num_heads"],
            vocab_size=int(embed.shape[0]), vlm_width=int(embed.shape[1]),
            vlm_depth=len({n.split(".")[1] for n in state_dict if n.startswith("layers.")}),
            vlm_mlp_dim=int(state_dict["layers.0.vlm.mlp.gate_proj.weight"].shape[0]),
            expert_width=int(state_dict["action_in_proj.weight"].shape[0]),
            expert_mlp_dim=int(state_dict["layers.0.expert.mlp.gate_proj.weight"].shape[0]),
            num_heads=LEROBOT_NUM_HEADS, head_dim=int(q.shape[0]) // LEROBOT_NUM_HEADS)
        sizes["num_kv_heads"] = int(k.shape[0]) // sizes["head_dim"]
    except KeyError as exc:
        raise LoongError(f"lerobot -> pi05: the state dict has no {exc.args[0]} (not a PI05Policy)") from exc
    c = lerobot_config
    if tuple(c.image_resolution)[0] != tuple(c.image_resolution)[1]:
        raise LoongError(f"lerobot -> pi05: image_resolution {c.image_resolution} is not square")
    fields = dict(
        chunk_size=c.chunk_size, n_action_steps=c.n_action_steps, max_state_dim=c.max_state_dim,
        max_action_dim=c.max_action_dim, num_inference_steps=c.num_inference_steps,
        time_sampling_beta_alpha=c.time_sampling_beta_alpha, time_sampling_beta_beta=c.time_sampling_beta_beta,
        time_sampling_scale=c.time_sampling_scale, time_sampling_offset=c.time_sampling_offset,
        min_period=c.min_period, max_period=c.max_period, image_size=int(c.image_resolution[0]),
        empty_cameras=c.empty_cameras, tokenizer_max_length=c.tokenizer_max_length,
        tune_visual=not (c.freeze_vision_encoder or c.train_expert_only), tune_llm=not c.train_expert_only,
        **sizes)
    fields.update(overrides)
    return Pi05Config(**fields), state_dict


def lerobot_processors(lerobot_config: Any, processor: Pi05Processor, source: int = 0) -> tuple[Any, Any]:
    """lerobot's Pi0.5 pre/post-processor pipelines with ``processor``'s statistics (of dataset ``source`` for a
    mix-trained processor: lerobot's normaliser holds one dataset's) and tokenizer, step for step as
    ``make_pi05_pre_post_processors`` builds them. The tokenizer step records lerobot's hard-coded tokenizer id,
    so the saved pipeline loads as lerobot's own does."""
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep
    from lerobot.processor import (
        AbsoluteActionsProcessorStep,
        RelativeActionsProcessorStep,
        TokenizerProcessorStep,
        make_default_policy_processor_steps,
        make_policy_processor_pipelines,
    )

    from loong.embodied.policies.pi05.config import PALIGEMMA_TOKENIZER

    c = lerobot_config
    if not 0 <= source < len(processor.normalizers):
        raise LoongError(f"pi05 -> lerobot: dataset index {source} is not one of the policy's "
                         f"{len(processor.normalizers)} datasets")
    steps = make_default_policy_processor_steps(c, processor.normalizers[source].stats)
    relative = RelativeActionsProcessorStep(enabled=c.use_relative_actions, exclude_joints=c.relative_exclude_joints,
                                            action_names=c.action_feature_names)
    tokenize = TokenizerProcessorStep(tokenizer=processor.tokenizer, max_length=c.tokenizer_max_length,
                                      padding_side="right", padding="max_length")
    # record the id lerobot's Pi0.5 processor loads its tokenizer from (the loaded object stays in use)
    tokenize.tokenizer_name, tokenize.tokenizer = PALIGEMMA_TOKENIZER, None
    pre = [steps.rename_observations, steps.add_batch_dim, relative, steps.normalize,
           Pi05PrepareStateTokenizerProcessorStep(max_state_dim=c.max_state_dim), tokenize, steps.to_device]
    post = [steps.unnormalize, AbsoluteActionsProcessorStep(enabled=c.use_relative_actions, relative_step=relative),
            steps.to_cpu]
    return make_policy_processor_pipelines(input_steps=pre, output_steps=post)


__all__ = ["DERIVED_FROM", "FIX_DERIVED_FROM", "LEROBOT_TYPE", "PREFIXES", "fix_checkpoint", "from_lerobot", "from_lerobot_name", "lerobot_processors",
           "to_lerobot", "to_lerobot_name"]
