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
and ``embodiment_tag``), so an export is for one dataset of the mix: ``source`` (``convert --dataset-index``,
``train.save_lerobot_dataset``; default: the first), logged with the choices. ``to_lerobot`` and ``lerobot_processors`` take it as ``source``.

Conversions stream (issue 25): an export reads the checkpoint one tensor at a time (:class:`CheckpointWeights`) and
writes lerobot's single ``model.safetensors`` one tensor at a time (the core's ``write_safetensors``); an import
reads ``model.safetensors`` one tensor at a time (the core's ``LazyTensors``). The mappings are written for whole
state dicts; :class:`MappedWeights` applies them lazily (run once on meta tensors to learn which output is which
input, renamed; the few outputs a mapping computes, lerobot's LM-head copies, from the inputs it names in
``DERIVED_FROM`` / ``FIX_DERIVED_FROM``).

Exported folders hold no absolute paths: files an export writes inside itself (GR00T's ``groot_base/``) are named
relative to the folder (``./groot_base``), so the folder can be moved or copied whole.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from loong.core.checkpoint.safetensors_io import (
    CONVERT_DTYPES,
    LazyTensors,
    SafetensorsFolder,
    compare_tensors,
    progress_bar,
    verify_summary,
    write_safetensors,
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
                       "with train.save_lerobot_dataset=N|NAME (training) or `loong-embodied convert RUN DST "
                       "--dataset-index N|NAME`", len(sources), choices, index,
                       sources[index].get("name"))
    return index


def _with_option(fn: Any, name: str, value: Any) -> dict[str, Any]:
    """``{name: value}`` for a mapping function that takes ``name``."""
    return {name: value} if name in inspect.signature(fn).parameters else {}


def _with_source(fn: Any, index: int) -> dict[str, Any]:
    """``{"source": index}`` for a mapping function that takes it (every shipped mapping does)."""
    return _with_option(fn, "source", index)


def target_dtype(dtype: str, saved: torch.dtype) -> torch.dtype:
    """The dtype ``convert --dtype dtype`` writes a tensor saved as ``saved`` in: a floating tensor in
    ``bf16``/``fp32``/``fp16``, or for ``auto`` as saved; integer and bool tensors (ids, masks) are never cast. No
    policy model is built in a conversion, so a source of mixed dtypes (lerobot keeps some of Pi0.5's norms in
    fp32) stays mixed."""
    if dtype != "auto" and dtype not in CONVERT_DTYPES:
        raise LoongError(f"--dtype {dtype}: one of auto, {', '.join(CONVERT_DTYPES)}")
    return (CONVERT_DTYPES.get(dtype) or saved) if saved.is_floating_point else saved


def _meta(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fresh meta tensor (shape, dtype) for every tensor of ``state``, nothing read: a lazy mapping's ``meta()``
    (a :class:`~loong.core.checkpoint.safetensors_io.LazyTensors`' with its cast applied), else the tensors'."""
    if isinstance(state, LazyTensors):
        return {k: state.cast(v) for k, v in state.meta().items()}
    meta = state.meta() if hasattr(state, "meta") else state
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in meta.items()}


class _Lazy(Mapping[str, torch.Tensor]):
    """A read-only mapping whose names are known up front (``_names``) and whose tensors are read only by
    ``[key]`` (``in`` reads nothing, unlike ``Mapping``'s default, which looks the tensor up)."""

    _names: Mapping[str, Any]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: object) -> bool:
        return key in self._names


class CheckpointWeights(_Lazy):
    """A policy's tensors in its DCP checkpoint ``step_dir``, read one whole tensor at a time when asked for (only
    that tensor's bytes are read), cast by the ``--dtype`` rule (:func:`target_dtype`). ``expected``: the policy's
    state dict (e.g. on the meta device), checked against the checkpoint's metadata; ``ema``: the moving averages
    of the weights where the run kept them (:func:`~loong.embodied.inference.weight_sources`)."""

    def __init__(self, step_dir: str | Path, expected: Mapping[str, torch.Tensor], *, ema: bool = False,
                 dtype: str = "auto") -> None:
        from loong.embodied.inference import weight_sources

        self.step_dir = Path(step_dir)
        self.sources = self._names = weight_sources(self.step_dir, expected, ema=ema)
        self.dtypes = {k: target_dtype(dtype, saved) for k, (_, _, saved) in self.sources.items()}

    @classmethod
    def of_checkpoint(cls, step_dir: str | Path, dtype: str = "auto") -> CheckpointWeights:
        """Every model tensor the checkpoint holds (``model.*``), as its metadata lists them."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
        shapes = {k.removeprefix("model."): torch.empty(tuple(v.size), device="meta") for k, v in meta.items()
                  if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
        return cls(step_dir, shapes, dtype=dtype)

    def __getitem__(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        saved_key, shape, saved = self.sources[key]
        group, name = saved_key.split(".", 1)
        out = torch.empty(shape, dtype=saved)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({group: {name: out}}, checkpoint_id=str(self.step_dir))  # in place: this tensor's chunks
        return out.to(self.dtypes[key])

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor as a meta tensor of its shape and written dtype (nothing read)."""
        return {k: torch.empty(shape, dtype=self.dtypes[k], device="meta") for k, (_, shape, _) in
                self.sources.items()}


class MappedWeights(_Lazy):
    """``fn(source)`` for a function of whole state dicts (a mapping's ``to_lerobot`` weights, ``fix_checkpoint``,
    ``from_lerobot``), holding neither side: ``fn`` first runs on meta tensors, which tells, for each output, the
    source tensor it passes on unchanged (read from ``source`` when that output is asked for). The outputs ``fn``
    computes (lerobot's copies of the embedding as LM heads) come from one more run of ``fn`` with the source
    tensors ``derived_from`` read (every source tensor when None: correct, but not streamed), when the first of
    them is asked for; each is held until it is taken."""

    def __init__(self, fn: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
                 source: Mapping[str, torch.Tensor], derived_from: Iterable[str] | None = None) -> None:
        self.fn, self.source = fn, source
        self._shapes = _meta(source)
        origin = {id(t): k for k, t in self._shapes.items()}
        out = fn(self._shapes)
        self._from = self._names = {name: origin.get(id(t)) for name, t in out.items()}
        self._meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in out.items()}
        self._derived_from = list(self._shapes) if derived_from is None else list(derived_from)
        self._derived: dict[str, torch.Tensor] = {}

    def derived(self) -> list[str]:
        """The outputs ``fn`` computes rather than passes on."""
        return [k for k, src in self._from.items() if src is None]

    def __getitem__(self, key: str) -> torch.Tensor:
        src = self._from[key]
        if src is not None:
            return self.source[src]
        if key not in self._derived:
            real = {k: self.source[k] for k in self._derived_from if k in self._shapes}
            out = self.fn({**self._shapes, **real})
            self._derived = {k: out[k] for k in self.derived()}
            unread = sorted(k for k, t in self._derived.items() if t.is_meta)
            if unread:  # the mapping's declaration of what it derives from is incomplete
                raise LoongError(f"{unread[0]} is computed from tensors other than {self._derived_from}; the "
                                 "mapping must name them")
        return self._derived.pop(key)

    def meta(self) -> dict[str, torch.Tensor]:
        """Every output as a meta tensor of its shape and dtype (nothing read)."""
        return dict(self._meta)


def lerobot_weights(mapping: ModuleType, config: PolicyConfig, state_dict: Mapping[str, torch.Tensor],
                    processor: PolicyProcessor | None, **options: Any) -> tuple[Any, MappedWeights]:
    """``(lerobot config, weights)``: the mapping's ``to_lerobot`` of ``state_dict`` (a dict, or a lazy mapping
    such as :class:`CheckpointWeights`), its weights a :class:`MappedWeights` in lerobot's names that reads each
    tensor when asked for (nothing is read here: what lerobot cannot hold is refused first)."""
    holder: list[Any] = []

    def weights(state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        lerobot_config, out = mapping.to_lerobot(config, state, processor, **options)
        holder.append(lerobot_config)
        return out

    mapped = MappedWeights(weights, state_dict, getattr(mapping, "DERIVED_FROM", None))
    return holder[0], mapped


def export_lerobot(policy_name: str, config: PolicyConfig, state_dict: Mapping[str, torch.Tensor],
                   processor: PolicyProcessor, dst: str | Path, *, source: int | str | None = None,
                   progress: bool = False, **mapping_options: Any) -> Path:
    """Write ``dst``, a folder lerobot's ``<Policy>.from_pretrained(dst)`` and ``make_pre_post_processors(config,
    pretrained_path=dst)`` load, from a Loong policy's config, state dict and processor. ``state_dict``: a dict on
    the host, or a lazy mapping (:class:`CheckpointWeights`) whose tensors are read one at a time as
    ``model.safetensors`` is written (:func:`~loong.core.checkpoint.safetensors_io.write_safetensors`: the header
    from the shapes first, then one tensor at a time; the few tensors the mapping computes, lerobot's LM-head copies
    of the embedding, are held while written). ``source``: for a policy trained on a mix, the dataset (index, folder
    or name; default: the first) whose statistics and embodiment the folder carries. ``mapping_options`` go to the
    mapping's ``to_lerobot`` (over the mapping's ``export_options``); ``progress``: a progress bar on stderr.
    Returns ``dst``."""
    mapping = mapping_of(policy_name)
    dst = Path(dst)
    index = _export_source(processor, source)
    to_options = _with_source(mapping.to_lerobot, index)
    extra = getattr(mapping, "export_options", None)
    # the conversion first (it refuses what lerobot cannot hold), with the mapping's options checked unwritten
    lerobot_weights(mapping, config, state_dict, processor, **to_options,
                    **{**(extra(config, state_dict, None) if extra else {}), **mapping_options})
    dst.mkdir(parents=True, exist_ok=True)
    with progress_bar(progress, "convert") as bar:
        written = extra(config, state_dict, dst, **_with_option(extra, "progress", bar)) if extra else {}
        lerobot_config, weights = lerobot_weights(mapping, config, state_dict, processor, **to_options,
                                                  **{**written, **mapping_options})
        lerobot_config._save_pretrained(dst)
        # tied weights as lerobot's save_pretrained writes them: the copy its from_pretrained re-ties stays out;
        # the computed tensors last, so that they are held only while written
        tied = set(getattr(mapping, "TIED_IN_FILE", ()))
        derived = set(weights.derived())
        names = sorted((k for k in weights if k not in tied), key=lambda k: (k in derived, k))
        meta = weights.meta()
        task = bar.add_task("convert", total=sum(meta[k].numel() for k in names), name="")
        # as lerobot's PreTrainedPolicy._save_pretrained writes a gathered state dict: one model.safetensors
        write_safetensors(dst / WEIGHTS_FILE, {k: (meta[k].shape, meta[k].dtype) for k in names},
                          weights.__getitem__, progress=(bar, task))
    pre, post = mapping.lerobot_processors(lerobot_config, processor,
                                           **_with_source(mapping.lerobot_processors, index))
    pre.save_pretrained(dst)
    post.save_pretrained(dst)
    return dst


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


def import_lerobot(src: str | Path, *, dtype: str = "auto", lazy: bool = False, **overrides: Any
                   ) -> tuple[str, PolicyConfig, Mapping[str, torch.Tensor], dict[str, dict[str, torch.Tensor]] | None]:
    """``(policy_name, config, state_dict, stats)`` of the LeRobot policy folder ``src`` (for fine-tuning from it):
    the Loong policy its type maps to, its config and weights in Loong's names (as lerobot's ``from_pretrained``
    would load them; floating tensors in ``dtype``, :func:`target_dtype`), and its normaliser statistics (None
    when it has no preprocessor). ``model.safetensors`` is read one tensor at a time
    (:class:`~loong.core.checkpoint.safetensors_io.LazyTensors`; tensors Loong does not hold, lerobot's LM heads,
    are never read); ``lazy``: the weights as a :class:`MappedWeights` that reads each when asked for, else a
    dict. ``overrides`` go to the mapping's ``from_lerobot`` (config fields, e.g. ``tokenizer``)."""
    import lerobot.policies  # noqa: F401  (registers every lerobot policy config type, e.g. "groot", with draccus)
    from lerobot.configs import PreTrainedConfig

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
    target_dtype(dtype, torch.float32)  # a bad --dtype fails before anything is read
    folder = SafetensorsFolder(src, stem=WEIGHTS_FILE.removesuffix(".safetensors"), what="lerobot policy folder")
    state: Mapping[str, torch.Tensor] = LazyTensors(folder, cast=lambda t: t.to(target_dtype(dtype, t.dtype)))
    fix = getattr(mapping, "fix_checkpoint", None)
    if fix is not None:
        state = MappedWeights(fix, state, getattr(mapping, "FIX_DERIVED_FROM", None))
    if "folder" in inspect.signature(mapping.from_lerobot).parameters:  # paths in the folder are relative to it
        overrides = {"folder": src, **overrides}
    config, _ = mapping.from_lerobot(lerobot_config, _meta(state), **overrides)  # sizes from the shapes alone
    loong = MappedWeights(lambda s: mapping.from_lerobot(lerobot_config, s, **overrides)[1], state)
    return policy_name, config, loong if lazy else {k: loong[k] for k in loong}, read_lerobot_stats(src)


def verify_export(dst: str | Path, policy_name: str, config: PolicyConfig, state_dict: Mapping[str, torch.Tensor],
                  processor: PolicyProcessor, *, source: int | str | None = None, progress: bool = False,
                  start: float | None = None) -> str:
    """``--verify`` of an :func:`export_lerobot`: the folder's ``model.safetensors``, reread, against the policy's
    ``state_dict`` (reread from the checkpoint by the caller: a dict or a :class:`CheckpointWeights`) through the
    mapping's ``to_lerobot`` (lerobot's names; the tied copies lerobot re-ties are not in the file), cast to the
    file's dtype, bit for bit, the same names; one tensor of each side at a time. A one-line summary;
    :class:`~loong.core.checkpoint.safetensors_io.VerifyError` on the first difference."""
    start = time.perf_counter() if start is None else start
    mapping = mapping_of(policy_name)
    dst = Path(dst)
    index = _export_source(processor, source)
    extra = getattr(mapping, "export_options", None)
    options = extra(config, state_dict, None) if extra else {}  # the options only: nothing is written again
    _, expected = lerobot_weights(mapping, config, state_dict, processor,
                                  **_with_source(mapping.to_lerobot, index), **options)
    tied = set(getattr(mapping, "TIED_IN_FILE", ()))
    written = SafetensorsFolder(dst, stem=WEIGHTS_FILE.removesuffix(".safetensors"), what="lerobot policy folder")
    result = compare_tensors(written, expected, str(dst / WEIGHTS_FILE), "the checkpoint",
                             ignore=lambda k: k in tied, progress=progress)
    return verify_summary([result], "lerobot", "Loong", start)


def verify_import(src: str | Path, step_dir: str | Path, *, progress: bool = False) -> str:
    """``--verify`` of a lerobot folder → Loong checkpoint: the checkpoint's model tensors, reread from its DCP
    files, against the folder reread through :func:`import_lerobot` (the mapping's ``from_lerobot``: Loong's
    names), cast to the checkpoint's dtype, bit for bit, the same names; one tensor of each side at a time. A
    one-line summary; :class:`~loong.core.checkpoint.safetensors_io.VerifyError` on the first difference."""
    start = time.perf_counter()
    _, _, source, _ = import_lerobot(src, lazy=True)
    result = compare_tensors(CheckpointWeights.of_checkpoint(step_dir), source, str(step_dir), str(src),
                             progress=progress)
    return verify_summary([result], "Loong", "lerobot", start)


__all__ = ["CheckpointWeights", "MappedWeights", "export_lerobot", "import_lerobot", "lerobot_weights", "mapping_of",
           "read_lerobot_stats", "target_dtype", "verify_export", "verify_import"]
