"""GR00T N1.7 <-> lerobot 0.6.1 ``GrootPolicy``: the name and config mapping, declared once.

State-dict names (Loong -> lerobot)::

    backbone.visual.*            -> _groot_model.backbone.model.model.visual.*
    backbone.language_model.*    -> _groot_model.backbone.model.model.language_model.*
    action_head.*                -> _groot_model.action_head.*
    (none: Qwen3VLModel has no LM head) <- _groot_model.backbone.model.lm_head.weight  (tied to embed_tokens:
                                                                                   dropped on import, a copy of
                                                                                   embed_tokens on export)

Config: lerobot's ``GrootConfig`` carries the policy-level knobs (chunk, max dims, tune flags, embodiment tag);
the network's shape lives in the raw GR00T base checkpoint it names (``base_model_path/config.json``, a
``GR00TN17Config``) and the backbone's in that config's ``model_name`` (Cosmos-Reason2-2B: lerobot's hard-coded
copy). :func:`write_lerobot_base` writes such a base checkpoint for a Loong config, since lerobot's
``GrootPolicy`` always builds itself from one; :func:`export_options` has ``export_lerobot`` write it inside the
export (``<export>/groot_base/``, with the backbone's config in ``groot_base/backbone/``) for a non-published
backbone, so that the folder loads offline. Those paths are written relative to the export folder
(``./groot_base``, ``./groot_base/backbone``), so the folder can be moved whole: Loong's import resolves them
against the folder; lerobot 0.6.1 resolves them from the current directory, so lerobot loads such an export with
the export folder as its working directory (a published-shape export names only hub ids and loads from anywhere).

A mix-trained policy exports one dataset's min/max statistics and embodiment (``source``; lerobot's GR00T pack
step holds one ``embodiment_tag``): the tag whose id is that dataset's ``data.embodiment_ids`` entry, or, for an
id no lerobot tag names, ``loong_embodiment_<id>`` added to the pack step's ``embodiment_mapping``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from loong.core.checkpoint.safetensors_io import write_safetensors
from loong.core.errors import LoongError
from loong.embodied.policies.groot_n1_7.config import EMBODIMENT_IDS, GrootN17Config

#: lerobot 0.6.1's policy type of its GR00T (N1.7) ``GrootPolicy``
LEROBOT_TYPE = "groot"
COSMOS_REASON2 = "nvidia/Cosmos-Reason2-2B"
GROOT_N1_7_BASE = "nvidia/GR00T-N1.7-3B"
#: the folder inside an export that holds the base checkpoint of a non-published backbone
EXPORT_BASE_DIR = "groot_base"
#: how an export names it: "./" keeps huggingface_hub from taking it for a hub repo id
EXPORT_BASE_PATH = f"./{EXPORT_BASE_DIR}"
#: the tag of an embodiment id that no lerobot tag names
CUSTOM_TAG = "loong_embodiment_{}"

#: (Loong prefix, lerobot prefix), longest first
PREFIXES: tuple[tuple[str, str], ...] = (
    ("backbone.visual.", "_groot_model.backbone.model.model.visual."),
    ("backbone.language_model.", "_groot_model.backbone.model.model.language_model."),
    ("action_head.", "_groot_model.action_head."),
)
LM_HEAD = "_groot_model.backbone.model.lm_head.weight"
EMBED_TOKENS = "backbone.language_model.embed_tokens.weight"
#: the Loong tensors :func:`to_lerobot` computes lerobot tensors from (the LM head), besides renaming: a streamed
#: export (``lerobot_io.MappedWeights``) reads only these to compute them
DERIVED_FROM = (EMBED_TOKENS,)

#: Loong config field -> lerobot GR00TN17Config field (the network shape in the base checkpoint's config.json)
MODEL_FIELDS: dict[str, str] = {
    "select_layer": "select_layer", "hidden_size": "hidden_size", "input_embedding_dim": "input_embedding_dim",
    "backbone_embedding_dim": "backbone_embedding_dim", "num_embodiments": "max_num_embodiments",
    "state_history_length": "state_history_length", "add_pos_embed": "add_pos_embed",
    "max_seq_len": "max_seq_len", "use_vlln": "use_vlln", "state_dropout_prob": "state_dropout_prob",
    "use_alternate_vl_dit": "use_alternate_vl_dit", "attend_text_every_n_blocks": "attend_text_every_n_blocks",
    "noise_beta_alpha": "noise_beta_alpha", "noise_beta_beta": "noise_beta_beta", "noise_s": "noise_s",
    "num_timestep_buckets": "num_timestep_buckets", "max_state_dim": "max_state_dim",
    "max_action_dim": "max_action_dim", "chunk_size": "action_horizon",
    "num_inference_steps": "num_inference_timesteps",
}
#: Loong field -> key of GR00TN17Config.diffusion_model_cfg / vl_self_attention_cfg
DIT_FIELDS = {"dit_num_layers": "num_layers", "dit_num_heads": "num_attention_heads",
              "dit_head_dim": "attention_head_dim", "dit_dropout": "dropout"}
VL_SA_FIELDS = {"vl_self_attention_layers": "num_layers", "vl_self_attention_heads": "num_attention_heads",
                "vl_self_attention_head_dim": "attention_head_dim", "vl_self_attention_dropout": "dropout"}
#: Loong field -> lerobot GrootConfig field (policy level)
POLICY_FIELDS = {"chunk_size": "chunk_size", "n_action_steps": "n_action_steps", "max_state_dim": "max_state_dim",
                 "max_action_dim": "max_action_dim", "tune_llm": "tune_llm", "tune_visual": "tune_visual",
                 "tune_projector": "tune_projector", "tune_diffusion_model": "tune_diffusion_model",
                 "tune_vlln": "tune_vlln", "tune_top_llm_layers": "tune_top_llm_layers",
                 "embodiment_tag": "embodiment_tag", "num_inference_steps": "num_inference_timesteps"}


def to_lerobot_key(name: str) -> str:
    for ours, theirs in PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise LoongError(f"groot_n1_7 -> lerobot: no lerobot name for parameter '{name}'")


to_lerobot_name = to_lerobot_key


def from_lerobot_key(name: str) -> str | None:
    """The Loong name of a lerobot GrootPolicy key (None: the tied LM head, which Loong does not hold)."""
    if name == LM_HEAD:
        return None
    for ours, theirs in PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    raise LoongError(f"lerobot -> groot_n1_7: unknown GrootPolicy parameter '{name}'")


from_lerobot_name = from_lerobot_key


def lerobot_model_config(config: GrootN17Config, model_name: str) -> dict[str, Any]:
    """lerobot ``GR00TN17Config`` kwargs (fp32) for ``config``, with the backbone at ``model_name``."""
    out: dict[str, Any] = {theirs: getattr(config, ours) for ours, theirs in MODEL_FIELDS.items()}
    out.update(model_name=model_name, backbone_model_type="qwen", model_dtype="float32", dtype="float32",
               tune_llm=config.tune_llm, tune_visual=config.tune_visual, tune_projector=config.tune_projector,
               tune_diffusion_model=config.tune_diffusion_model, tune_vlln=config.tune_vlln,
               tune_top_llm_layers=config.tune_top_llm_layers)
    out["diffusion_model_cfg"] = {
        "positional_embeddings": None, "norm_type": "ada_norm", "final_dropout": True,
        "output_dim": config.hidden_size, "interleave_self_attention": True,
        **{theirs: getattr(config, ours) for ours, theirs in DIT_FIELDS.items()}}
    out["vl_self_attention_cfg"] = {
        "positional_embeddings": None, "final_dropout": True,
        **{theirs: getattr(config, ours) for ours, theirs in VL_SA_FIELDS.items()}}
    return out


def _local(path: str, folder: Path | None) -> Path:
    """``path`` (a local folder named in an export) resolved against ``folder`` when relative."""
    p = Path(path).expanduser()
    return folder / p if folder is not None and not p.is_absolute() else p


def config_from_lerobot_model(model_config: Mapping[str, Any], *, folder: Path | None = None,
                              **policy: Any) -> GrootN17Config:
    """A Loong config from a ``GR00TN17Config`` (dict or object) plus Loong policy-level fields ``policy``;
    ``folder``: what a relative backbone ``model_name`` is relative to (the export folder)."""
    get = (model_config.get if isinstance(model_config, Mapping)
           else lambda k, d=None: getattr(model_config, k, d))
    fields: dict[str, Any] = {}
    for ours, theirs in MODEL_FIELDS.items():
        if get(theirs) is not None:
            fields[ours] = get(theirs)
    dit, vl_sa = get("diffusion_model_cfg") or {}, get("vl_self_attention_cfg") or {}
    fields.update({ours: dit[theirs] for ours, theirs in DIT_FIELDS.items() if theirs in dit})
    fields.update({ours: vl_sa[theirs] for ours, theirs in VL_SA_FIELDS.items() if theirs in vl_sa})
    if dit.get("output_dim", fields.get("hidden_size")) != fields.get("hidden_size", 1024):
        raise LoongError("lerobot -> groot_n1_7: diffusion_model_cfg.output_dim must equal hidden_size")
    if vl_sa.get("num_layers", 0) == 0:
        fields["vl_self_attention_layers"] = 0
    model_name = str(get("model_name") or COSMOS_REASON2)
    if model_name.rstrip("/") != COSMOS_REASON2:
        path = _local(model_name, folder) / "config.json"
        if not path.is_file():
            raise LoongError(f"lerobot -> groot_n1_7: backbone model_name {model_name!r} is not a local folder "
                             "with config.json (only nvidia/Cosmos-Reason2-2B is known without one)")
        fields["backbone"] = {k: v for k, v in json.loads(path.read_text()).items()
                              if k not in ("architectures", "transformers_version", "model_type", "dtype")}
    fields.update(policy)
    return GrootN17Config(**fields)


def from_lerobot(lerobot_config: Any, lerobot_state_dict: Mapping[str, torch.Tensor], *,
                 model_config: Mapping[str, Any] | Any | None = None,
                 processor: str | None = None,
                 folder: Path | None = None) -> tuple[GrootN17Config, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` of a lerobot ``GrootPolicy``: its ``GrootConfig``, its state dict, and the
    network's ``GR00TN17Config`` (``model_config``; default: read from ``base_model_path/config.json``).
    ``folder``: the policy folder, which relative paths in it (an export's ``./groot_base``) are relative to."""
    if model_config is None:
        path = base_config_file(str(lerobot_config.base_model_path), folder)
        model_config = json.loads(path.read_text())
    # the network's shape (horizon, max dims) is the base checkpoint's; GrootConfig adds the policy knobs
    policy = {ours: getattr(lerobot_config, theirs) for ours, theirs in POLICY_FIELDS.items()
              if ours not in ("chunk_size", "max_state_dim", "max_action_dim")
              and getattr(lerobot_config, theirs, None) is not None}
    if policy.get("embodiment_tag") not in EMBODIMENT_IDS:
        policy.pop("embodiment_tag", None)
    horizon = (model_config.get("action_horizon") if isinstance(model_config, Mapping)
               else getattr(model_config, "action_horizon", None)) or 40
    policy["n_action_steps"] = min(int(policy.get("n_action_steps", horizon)), int(horizon))
    policy["processor"] = processor
    config = config_from_lerobot_model(model_config, folder=folder, **policy)
    state: dict[str, torch.Tensor] = {}
    for name, value in lerobot_state_dict.items():
        ours = from_lerobot_key(name)
        if ours is not None:
            state[ours] = value
    return config, state


def base_config_file(base_model_path: str, folder: Path | None = None) -> Path:
    """The ``config.json`` of the GR00T base checkpoint ``base_model_path``: a local folder (relative to
    ``folder`` when relative and ``folder`` is given), else the Hugging Face cache's copy of that repository
    (never downloaded)."""
    path = _local(base_model_path, folder) / "config.json"
    if path.is_file():
        return path
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(base_model_path, "config.json") if "/" in base_model_path else None
    if isinstance(cached, str) and Path(cached).is_file():
        return Path(cached)
    raise LoongError(f"lerobot -> groot_n1_7: base_model_path={base_model_path!r}: neither a local folder with "
                     "config.json nor in the Hugging Face cache (download it, or pass model_config: the "
                     "GR00TN17Config of the policy, e.g. policy._groot_model.config)")


def export_options(config: GrootN17Config, state_dict: Mapping[str, torch.Tensor],
                   dst: Path | None, progress: Any = None) -> dict[str, Any]:
    """The ``to_lerobot`` options of an export to ``dst``: for a non-published backbone, the base checkpoint
    :func:`write_lerobot_base` writes into ``dst/groot_base`` (``dst=None``: only the options, nothing written,
    for the pre-training check); the published shape keeps nvidia's base (no options). ``progress``: a rich
    progress bar the base's writing adds its task to."""
    if config.backbone is None:
        return {}
    if dst is None:
        return {"base_model_path": EXPORT_BASE_PATH}
    # paths relative to the export, so the folder stays whole when moved (see the module docstring)
    write_lerobot_base(config, state_dict, Path(dst) / EXPORT_BASE_DIR, model_name=f"{EXPORT_BASE_PATH}/backbone",
                       progress=progress)
    return {"base_model_path": EXPORT_BASE_PATH}


def source_embodiment(config: GrootN17Config, processor: Any, source: int = 0) -> tuple[str, int]:
    """``(embodiment_tag, embodiment_id)`` of ``processor``'s dataset ``source`` as lerobot names it: the
    config's tag for a policy of one dataset (or a source of the config's id), else the lerobot tag of the
    source's id, else :data:`CUSTOM_TAG`."""
    sources = getattr(processor, "sources", None) if processor is not None else None
    if not sources:
        return config.embodiment_tag, config.embodiment_id
    if not 0 <= source < len(sources):
        raise LoongError(f"groot_n1_7 -> lerobot: dataset index {source} is not one of the policy's "
                         f"{len(sources)} datasets")
    eid = int(sources[source]["embodiment_id"])
    if eid == config.embodiment_id:
        return config.embodiment_tag, eid
    return next((tag for tag, i in EMBODIMENT_IDS.items() if i == eid), CUSTOM_TAG.format(eid)), eid


def to_lerobot(config: GrootN17Config, state_dict: Mapping[str, torch.Tensor], processor: Any = None, *,
               base_model_path: str | None = None, source: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(GrootConfig, state_dict)`` for lerobot's ``GrootPolicy``.

    ``base_model_path``: the raw GR00T base checkpoint lerobot builds the policy from (default: nvidia's
    GR00T-N1.7-3B, only right for the published shape; :func:`write_lerobot_base` writes one for any config).
    ``processor`` (a :class:`~.processor.GrootN17Processor`): gives the camera, state and action features;
    ``source``: for a mix-trained processor, the dataset whose embodiment the config names.
    """
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.groot.configuration_groot import GrootConfig

    if base_model_path is None:
        if config.backbone is not None:
            raise LoongError("groot_n1_7 -> lerobot: a non-published backbone needs base_model_path (see "
                             "write_lerobot_base)")
        base_model_path = GROOT_N1_7_BASE
    kwargs: dict[str, Any] = {theirs: getattr(config, ours) for ours, theirs in POLICY_FIELDS.items()}
    kwargs.update(base_model_path=base_model_path, use_bf16=False, model_params_fp32=True)
    if processor is not None:
        h, w = config.image_target_size
        inputs = {cam: PolicyFeature(type=FeatureType.VISUAL, shape=(3, h, w)) for cam in processor.camera_keys}
        inputs[processor.state_key] = PolicyFeature(type=FeatureType.STATE, shape=(processor.state_dim,))
        kwargs["input_features"] = inputs
        kwargs["output_features"] = {processor.action_key: PolicyFeature(type=FeatureType.ACTION,
                                                                          shape=(processor.action_dim,))}
    tag, _ = source_embodiment(config, processor, source)
    kwargs["embodiment_tag"] = tag
    lerobot_config = GrootConfig(**kwargs)
    for ours, theirs in POLICY_FIELDS.items():  # GrootConfig silently remaps "N1.5 defaults": refuse those
        if ours != "embodiment_tag" and getattr(lerobot_config, theirs) != getattr(config, ours):
            raise LoongError(f"groot_n1_7 -> lerobot: lerobot's GrootConfig changes {theirs}={getattr(config, ours)}"
                             f" to {getattr(lerobot_config, theirs)} (a GR00T N1.5 default); pick another value")
    out = {to_lerobot_key(k): v for k, v in state_dict.items()}
    if EMBED_TOKENS in state_dict:
        out[LM_HEAD] = state_dict[EMBED_TOKENS].clone()
    return lerobot_config, out


#: what lerobot's save_pretrained leaves out of model.safetensors (tied to LM_HEAD; its from_pretrained re-ties it)
TIED_IN_FILE = ("_groot_model.backbone.model.model.language_model.embed_tokens.weight",)


def fix_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A saved GrootPolicy file's keys as the policy holds them: the tied embedding back from the LM head."""
    state = dict(state)
    for key in TIED_IN_FILE:
        if key not in state and LM_HEAD in state:
            state[key] = state[LM_HEAD]
    return state


def lerobot_dataset_stats(processor: Any, source: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """The min/max statistics of dataset ``source`` (0 for a policy of one dataset) in the form lerobot's
    ``make_groot_pre_post_processors(dataset_stats=...)`` takes."""
    stats = processor.source_stats[source] if source else processor.stats
    return {k: {n: v.clone() for n, v in s.items()} for k, s in stats.items()}


def lerobot_processors(lerobot_config: Any, processor: Any, source: int = 0) -> tuple[Any, Any]:
    """lerobot's GR00T N1.7 pre/post-processor pipelines (``make_groot_pre_post_processors``) with the min/max
    statistics and embodiment of ``processor``'s dataset ``source``. lerobot's VLM-encode step names the
    hard-coded ``nvidia/Cosmos-Reason2-2B`` processor (saved pipelines load it from the HF cache); in this
    process it is handed ``processor``'s own Qwen3-VL processor."""
    from lerobot.policies.groot.processor_groot import (
        GrootN17PackInputsStep,
        GrootN17VLMEncodeStep,
        make_groot_pre_post_processors,
    )

    if not 0 <= source < len(processor.source_stats):
        raise LoongError(f"groot_n1_7 -> lerobot: dataset index {source} is not one of the policy's "
                         f"{len(processor.source_stats)} datasets")
    pre, post = make_groot_pre_post_processors(lerobot_config,
                                               dataset_stats=lerobot_dataset_stats(processor, source))
    _, eid = source_embodiment(processor.config, processor, source)
    for step in pre.steps:
        if isinstance(step, GrootN17VLMEncodeStep):
            step._proc = processor.vlm
        if isinstance(step, GrootN17PackInputsStep):  # the embodiment id the tag stands for (a custom tag too)
            step.embodiment_tag = lerobot_config.embodiment_tag
            step.embodiment_mapping = {**step.embodiment_mapping, lerobot_config.embodiment_tag: eid}
    return pre, post


def write_lerobot_base(config: GrootN17Config, state_dict: Mapping[str, torch.Tensor], directory: str | Path, *,
                       model_name: str | None = None, progress: Any = None) -> Path:
    """Write a raw GR00T N1.7 base checkpoint (``config.json`` + ``model.safetensors`` of ``GR00TN17``) with
    these weights into ``directory`` (and, for a non-published backbone, its Qwen3-VL ``config.json`` into
    ``directory/backbone``); the path is what :func:`to_lerobot`'s ``base_model_path`` names. ``model_name``: how
    the base's config names that backbone folder (default: its absolute path). The weights are written one tensor
    at a time; ``progress``: a rich progress bar to add the writing's task to."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backbone_name = COSMOS_REASON2
    if config.backbone is not None:
        from transformers import Qwen3VLConfig

        backbone_dir = directory / "backbone"
        Qwen3VLConfig(**config.backbone).save_pretrained(str(backbone_dir))
        backbone_name = model_name or str(backbone_dir.resolve())
    model_config = lerobot_model_config(config, backbone_name)
    model_config.update(model_type="Gr00tN1d7", architectures=["GR00TN17"])
    (directory / "config.json").write_text(json.dumps(model_config, indent=2))
    prefix = "_groot_model."
    # one tensor at a time (``state_dict`` may be a lazy mapping over a checkpoint: lerobot_io.CheckpointWeights)
    names = {to_lerobot_key(k)[len(prefix):]: k for k in state_dict}
    meta = state_dict.meta() if hasattr(state_dict, "meta") else state_dict
    entries = {n: (meta[k].shape, meta[k].dtype) for n, k in sorted(names.items())}
    task = None if progress is None else progress.add_task(
        "base", total=sum(math.prod(shape) for shape, _ in entries.values()), name="")
    write_safetensors(directory / "model.safetensors", entries, lambda n: state_dict[names[n]],
                      progress=None if progress is None else (progress, task))
    return directory


__all__ = ["CUSTOM_TAG", "DERIVED_FROM", "EXPORT_BASE_DIR", "EXPORT_BASE_PATH", "LEROBOT_TYPE", "source_embodiment", "TIED_IN_FILE", "fix_checkpoint", "PREFIXES", "base_config_file", "export_options", "from_lerobot", "from_lerobot_key", "from_lerobot_name", "lerobot_dataset_stats",
           "lerobot_model_config", "lerobot_processors", "to_lerobot", "to_lerobot_key", "to_lerobot_name",
           "write_lerobot_base"]
