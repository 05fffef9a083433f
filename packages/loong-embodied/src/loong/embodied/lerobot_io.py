"""Policy folders in LeRobot's format, written from and read into Loong policies (any policy with a mapping).

A LeRobot policy folder (what ``PreTrainedPolicy.save_pretrained`` and ``lerobot-train`` write) holds
``config.json`` (the policy config, with its ``"type"``), ``model.safetensors`` (the policy's state dict),
``policy_preprocessor.json`` / ``policy_postprocessor.json`` (the processor pipelines) and a safetensors file per
stateful step (the normaliser's statistics). Everything policy-specific comes from the policy's mapping module
(``POLICIES.get(name).lerobot``), which provides ``to_lerobot``, ``from_lerobot``, ``lerobot_processors``,
``LEROBOT_TYPE`` and optionally ``fix_checkpoint`` (the key fixes lerobot's own ``from_pretrained`` applies) and
``export_options(config, state_dict, dst)`` (files an export needs besides lerobot's, written into ``dst``, and the
``to_lerobot`` options naming them: GR00T N1.7's base checkpoint).

A policy trained on a mix of datasets (``data.repo_root`` a list) normalises each sample with its own dataset's
statistics and, for GR00T, routes it to its dataset's embodiment; a lerobot policy folder holds one set of
statistics and one embodiment (lerobot 0.6.1's normaliser and GR00T pack step each carry a single ``stats``
and ``embodiment_tag``), so an export is for one dataset of the mix: ``source`` (``convert --dataset-index``;
default: the first), logged with the choices. ``to_lerobot`` and ``lerobot_processors`` take it as ``source``.

Exported folders hold no absolute paths: files an export writes inside itself (GR00T's ``groot_base/``) are named
relative to the folder (``./groot_base``), so the folder can be moved or copied whole.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from loong.core.checkpoint.safetensors_io import (
    CONVERT_DTYPES,
    SafetensorsFolder,
    compare_tensors,
    verify_summary,
)
from loong.core.errors import LoongError
from loong.embodied.policies import POLICIES
from loong.embodied.policies.base import PolicyConfig, PolicyProcessor

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PREPROCESSOR_FILE = "policy_preprocessor.json"
POSTPROCESSOR_FILE = "policy_postprocessor.json"
NORMALIZER_STEP = "normalizer_processor"

logger = logging.getLogger(__name__)


def mapping_of(policy_name: str) -> ModuleType:
    """The LeRobot mapping module of the registered policy ``policy_name``."""
    spec = POLICIES.get(policy_name)
    if spec.lerobot is None:
        raise LoongError(f"policy {policy_name!r}: lerobot ships no such policy, so it has no LeRobot export")
    return importlib.import_module(spec.lerobot)


def _export_source(processor: PolicyProcessor, source: int | str | None) -> int:
    """The dataset index of a mix-trained ``processor`` an export is for (``source``: an index, a dataset folder
    or its name; None: 0), with a log line naming the choices; 0 for a policy of one dataset."""
    from loong.embodied.inference import resolve_source

    index = resolve_source(processor, source, what="--dataset-index")
    sources = getattr(processor, "sources", None) or []
    if len(sources) > 1:
        choices = ", ".join(f"{i}: {r.get('name')} (embodiment {r.get('embodiment_id')})"
                            for i, r in enumerate(sources))
        logger.warning("lerobot export: the policy was trained on %d datasets (%s); a lerobot folder holds one "
                       "dataset's statistics and embodiment, so this one is for dataset %d (%s); choose another "
                       "with `loong-embodied convert RUN DST --dataset-index N`", len(sources), choices, index,
                       sources[index].get("name"))
    return index


def _with_source(fn: Any, index: int) -> dict[str, Any]:
    """``{"source": index}`` for a mapping function that takes it (every shipped mapping does)."""
    return {"source": index} if "source" in inspect.signature(fn).parameters else {}


def export_lerobot(policy_name: str, config: PolicyConfig, state_dict: dict[str, torch.Tensor],
                   processor: PolicyProcessor, dst: str | Path, *, source: int | str | None = None,
                   **mapping_options: Any) -> Path:
    """Write ``dst``, a folder lerobot's ``<Policy>.from_pretrained(dst)`` and ``make_pre_post_processors(config,
    pretrained_path=dst)`` load, from a Loong policy's config, state dict (full, on the host) and processor.
    ``source``: for a policy trained on a mix, the dataset (index, folder or name; default: the first) whose
    statistics and embodiment the folder carries. ``mapping_options`` go to the mapping's ``to_lerobot`` (over
    the mapping's ``export_options``). Returns ``dst``."""
    from huggingface_hub import save_torch_state_dict

    mapping = mapping_of(policy_name)
    dst = Path(dst)
    index = _export_source(processor, source)
    to_options = _with_source(mapping.to_lerobot, index)
    # the conversion first (it refuses what lerobot cannot hold), with the mapping's options checked unwritten
    extra = getattr(mapping, "export_options", None)
    mapping.to_lerobot(config, {k: v.to("meta") for k, v in state_dict.items()}, processor, **to_options,
                       **{**(extra(config, state_dict, None) if extra else {}), **mapping_options})
    dst.mkdir(parents=True, exist_ok=True)
    options = {**(extra(config, state_dict, dst) if extra else {}), **mapping_options}
    lerobot_config, lerobot_state = mapping.to_lerobot(config, state_dict, processor, **to_options, **options)
    lerobot_config._save_pretrained(dst)
    # tied weights as lerobot's save_pretrained writes them: the copy its from_pretrained re-ties stays out
    tied = set(getattr(mapping, "TIED_IN_FILE", ()))
    tensors = {k: v.detach().cpu().contiguous() for k, v in lerobot_state.items() if k not in tied}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    # as lerobot's PreTrainedPolicy._save_pretrained writes a gathered state dict: one model.safetensors
    save_torch_state_dict(tensors, str(dst), max_shard_size=max(total, 1))
    pre, post = mapping.lerobot_processors(lerobot_config, processor,
                                           **_with_source(mapping.lerobot_processors, index))
    pre.save_pretrained(dst)
    post.save_pretrained(dst)
    return dst


def cast_state(state: Mapping[str, torch.Tensor], dtype: str,
               saved: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """``state`` in ``convert --dtype``'s dtype: every floating tensor cast to ``bf16``/``fp32``/``fp16``, or for
    ``auto`` kept as the source holds it (``saved[key]``, where given: the dtype the checkpoint stores, for a
    state loaded cast to fp32). Integer and bool tensors (ids, masks) are never cast. No policy model is built in
    a conversion, so a source of mixed dtypes (lerobot keeps some of Pi0.5's norms in fp32) stays mixed."""
    if dtype != "auto" and dtype not in CONVERT_DTYPES:
        raise LoongError(f"--dtype {dtype}: one of auto, {', '.join(CONVERT_DTYPES)}")
    out = {}
    for key, tensor in state.items():
        target = CONVERT_DTYPES.get(dtype) or (saved or {}).get(key, tensor.dtype)
        out[key] = tensor.to(target) if tensor.is_floating_point() else tensor
    return out


def saved_dtypes(step_dir: str | Path, keys: Iterable[str], ema: bool = False) -> dict[str, torch.dtype]:
    """The dtype each policy tensor ``keys`` has in the DCP checkpoint ``step_dir`` (``ema``: its moving average's,
    where the run kept one), from the checkpoint's metadata alone."""
    import torch.distributed.checkpoint as dcp

    from loong.core.engines.fsdp.checkpoint import EMA_KEY

    meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    out = {}
    for key in keys:
        entry = (meta.get(f"{EMA_KEY}.{key}") if ema else None) or meta.get(f"model.{key}")
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if dtype is not None:
            out[key] = dtype
    return out


def _policy_for_type(lerobot_type: str, src: Path) -> str:
    """The registered Loong policy whose mapping declares lerobot type ``lerobot_type`` (policies named like the
    type are tried first, so a Pi0.5 folder imports no other policy's code)."""
    names = sorted(POLICIES.names(), key=lambda n: (not n.startswith(lerobot_type), n))
    broken: list[str] = []
    for name in names:
        try:
            if POLICIES.get(name).lerobot is None:
                continue
            declared = getattr(mapping_of(name), "LEROBOT_TYPE", None)
        except ImportError as exc:  # a policy whose code cannot be imported cannot be the one
            broken.append(f"{name} ({exc})")
            continue
        if declared == lerobot_type:
            return name
    note = f"; these policies could not be imported: {', '.join(broken)}" if broken else ""
    raise LoongError(f"{src / CONFIG_FILE}: lerobot policy type {lerobot_type!r} maps to no Loong policy (Loong's "
                     f"policies: {', '.join(POLICIES.names())}){note}")


def read_lerobot_stats(src: Path) -> dict[str, dict[str, torch.Tensor]] | None:
    """The normaliser statistics in ``src``'s preprocessor (``{feature: {stat: tensor}}``), or None without one."""
    from safetensors.torch import load_file

    path = src / PREPROCESSOR_FILE
    if not path.is_file():
        return None
    try:
        pipeline = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise LoongError(f"{path}: not JSON ({exc})") from exc
    for step in pipeline.get("steps", []):
        if step.get("registry_name") == NORMALIZER_STEP and step.get("state_file"):
            state_path = src / step["state_file"]
            if not state_path.is_file():
                raise LoongError(f"{path}: its normaliser's statistics file {state_path} is missing")
            stats: dict[str, dict[str, torch.Tensor]] = {}
            for name, tensor in load_file(str(state_path)).items():
                key, stat = name.rsplit(".", 1)
                stats.setdefault(key, {})[stat] = tensor
            return stats
    return None


def import_lerobot(src: str | Path, **overrides: Any
                   ) -> tuple[str, PolicyConfig, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]] | None]:
    """``(policy_name, config, state_dict, stats)`` of the LeRobot policy folder ``src`` (for fine-tuning from it):
    the Loong policy its type maps to, its config and weights in Loong's names (as lerobot's ``from_pretrained``
    would load them), and its normaliser statistics (None when it has no preprocessor). ``overrides`` go to the
    mapping's ``from_lerobot`` (config fields, e.g. ``tokenizer``)."""
    import lerobot.policies  # noqa: F401  (registers every lerobot policy config type, e.g. "groot", with draccus)
    from lerobot.configs import PreTrainedConfig
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    src = Path(src).expanduser()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (src / name).is_file():
            raise LoongError(f"{src}: no {name} (a LeRobot policy folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        lerobot_type = json.loads((src / CONFIG_FILE).read_text(encoding="utf-8"))["type"]
    except (ValueError, KeyError) as exc:
        raise LoongError(f"{src / CONFIG_FILE}: not a LeRobot policy config (no \"type\")") from exc
    policy_name = _policy_for_type(str(lerobot_type), src)
    mapping = mapping_of(policy_name)
    lerobot_config = PreTrainedConfig.from_pretrained(str(src), local_files_only=True)
    try:
        state = load_file(str(src / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:  # truncated or not safetensors: one line, not a traceback
        raise LoongError(f"{src / WEIGHTS_FILE}: cannot read safetensors file ({exc})") from None
    fix = getattr(mapping, "fix_checkpoint", None)
    if fix is not None:
        state = fix(state)
    if "folder" in inspect.signature(mapping.from_lerobot).parameters:  # paths in the folder are relative to it
        overrides = {"folder": src, **overrides}
    config, state_dict = mapping.from_lerobot(lerobot_config, state, **overrides)
    return policy_name, config, state_dict, read_lerobot_stats(src)


def verify_export(dst: str | Path, policy_name: str, config: PolicyConfig, state_dict: dict[str, torch.Tensor],
                  processor: PolicyProcessor, *, source: int | str | None = None, progress: bool = False,
                  start: float | None = None) -> str:
    """``--verify`` of an :func:`export_lerobot`: the folder's ``model.safetensors``, reread, against the policy's
    ``state_dict`` (reread from the checkpoint by the caller) through the mapping's ``to_lerobot`` (lerobot's
    names; the tied copies lerobot re-ties are not in the file), cast to the file's dtype, bit for bit, the same
    names. A one-line summary; :class:`~loong.core.checkpoint.safetensors_io.VerifyError` on the first
    difference."""
    start = time.perf_counter() if start is None else start
    mapping = mapping_of(policy_name)
    dst = Path(dst)
    index = _export_source(processor, source)
    extra = getattr(mapping, "export_options", None)
    options = extra(config, state_dict, None) if extra else {}  # the options only: nothing is written again
    _, expected = mapping.to_lerobot(config, state_dict, processor, **_with_source(mapping.to_lerobot, index),
                                     **options)
    tied = set(getattr(mapping, "TIED_IN_FILE", ()))
    expected = {k: v for k, v in expected.items() if k not in tied}
    written = SafetensorsFolder(dst, stem=WEIGHTS_FILE.removesuffix(".safetensors"), what="lerobot policy folder")
    result = compare_tensors(written, expected, str(dst / WEIGHTS_FILE), "the checkpoint", progress=progress)
    return verify_summary([result], "lerobot", "Loong", start)


def verify_import(src: str | Path, step_dir: str | Path, *, progress: bool = False) -> str:
    """``--verify`` of a lerobot folder → Loong checkpoint: the checkpoint's model tensors, reread from its DCP
    files, against the folder reread through :func:`import_lerobot` (the mapping's ``from_lerobot``: Loong's
    names), cast to the checkpoint's dtype, bit for bit, the same names. A one-line summary;
    :class:`~loong.core.checkpoint.safetensors_io.VerifyError` on the first difference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    start = time.perf_counter()
    _, _, source, _ = import_lerobot(src)
    step_dir = Path(step_dir)
    meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    tensors = {k.removeprefix("model."): torch.empty(tuple(v.size), dtype=v.properties.dtype)
               for k, v in meta.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    dcp.load({"model": tensors}, checkpoint_id=str(step_dir))  # in place; needs no process group
    result = compare_tensors(tensors, source, str(step_dir), str(src), progress=progress)
    return verify_summary([result], "Loong", "lerobot", start)


__all__ = ["cast_state", "export_lerobot", "import_lerobot", "mapping_of", "read_lerobot_stats", "saved_dtypes",
           "verify_export", "verify_import"]
