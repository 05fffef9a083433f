"""Hugging Face ⇄ Loong for whole VLMs: the state dict, folders, ``model.init_from_hf`` and ``train.save_hf``.

Loong's side is the whole native state of :class:`~loong.vlm.models.vlm.VisionLanguageModel` (what
:func:`~loong.core.engines.megatron.state.gather_full_state` returns): ``encoder.*`` and ``projector.*`` (the
vision family's native keys, :mod:`loong.vlm.models.<family>.mapping`) and ``foundation.<loong-llm key>``
(:mod:`loong.vlm.models.text_mapping`). HF's side is the ``ForConditionalGeneration`` state dict, in one of two
file layouts (:class:`HFLayout`):

- **in memory** (transformers 5's module names): ``model.visual.*`` (Qwen) or ``model.vision_tower.*`` +
  ``model.multi_modal_projector.*`` (InternVL), ``model.language_model.*``, ``lm_head.weight`` (absent when tied);
- **legacy**, what transformers writes (and the published checkpoints hold) for Qwen2.5-VL (``visual.*``,
  ``model.*``) and InternVL (``vision_tower.*``, ``multi_modal_projector.*``, ``language_model.model.*``,
  ``language_model.lm_head.weight``).

Both are read; a folder is written in the family's published layout (:func:`canonical_layout`: legacy for
Qwen2.5-VL and InternVL, in-memory for Qwen3-VL, Qwen3-VL-MoE's fused experts in the published ``[E, D, 2F]``
form), which transformers 4.5x and 5 both load. The mapping is exactly invertible: a state read in a layout and
written back in that layout (:func:`layout_of`) is bit-exact. The config side is :mod:`loong.vlm.hf_config`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loong.core.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    LazyTensors,
    ShardWriter,
    progress_bar,
)
from loong.core.engines.megatron.state import gather_full_state, load_state_by_key
from loong.core.errors import LoongError
from loong.llm.hf_io import HFTensors, read_hf_folder, write_hf_metadata
from loong.llm.models.hf_mapping import hf_to_native_key as foundation_hf_to_native_key
from loong.llm.models.hf_mapping import is_stacked as foundation_is_stacked
from loong.llm.models.hf_mapping import native_shapes as foundation_shapes
from loong.vlm.hf_config import (
    VLMParts,
    check_parts,
    family_of_hf_config,
    generation_config_of,
    hf_config_of,
    parts_from_hf,
)
from loong.vlm.models.families import vision_family
from loong.vlm.models.text_mapping import (
    HUB,
    LM_HEAD,
    TEXT_PREFIX,
    ExpertsLayout,
    experts_layout_of,
    text_hf_to_native,
    text_native_to_hf,
    text_native_to_hf_key,
    text_taker,
)

Tensor = torch.Tensor
FOUNDATION = "foundation."
VISION_NATIVE = ("encoder.", "projector.")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: files that make a processor folder (besides the tokenizer's)
PROCESSOR_CONFIGS = ("processor_config.json", "preprocessor_config.json")

#: family -> (file prefix, in-memory prefix) of its legacy layout; a key takes the first pair whose prefix it has
LEGACY_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": (("visual.", "model.visual."), ("model.", "model.language_model.")),
    "internvl": (("vision_tower.", "model.vision_tower."),
                 ("multi_modal_projector.", "model.multi_modal_projector."),
                 ("language_model.model.", "model.language_model."),
                 ("language_model.lm_head.", "lm_head.")),
}
#: in-memory prefixes of each family's vision tensors
VISION_PREFIXES: dict[str, tuple[str, ...]] = {
    "qwen2_5_vl": ("model.visual.",), "qwen3_vl": ("model.visual.",), "qwen3_vl_moe": ("model.visual.",),
    "internvl": ("model.vision_tower.", "model.multi_modal_projector."),
}


@dataclass(frozen=True)
class HFLayout:
    """How a VLM's tensors are named and shaped in a file: ``legacy`` (the module docstring) and, for
    Qwen3-VL-MoE, the fused experts' layout (:data:`~loong.vlm.models.text_mapping.HUB` or ``transformers5``)."""

    legacy: bool = False
    experts: ExpertsLayout = HUB


def canonical_layout(family: str) -> HFLayout:
    """The layout a folder of ``family`` is written in: the published checkpoints'."""
    return HFLayout(legacy=family in LEGACY_RENAMES, experts=HUB)


# --- key layouts -------------------------------------------------------------------------------------
def _is_memory_key(key: str, family: str) -> bool:
    if key == LM_HEAD:
        return True
    if family == "qwen2_5_vl":
        return key.startswith(("model.visual.", TEXT_PREFIX))
    return key.startswith("model.")


def to_memory_layout(hf_state: Mapping[str, Tensor], family: str) -> tuple[dict[str, Tensor], bool]:
    """``(state with in-memory names, whether it was in the legacy layout)``; a state mixing both is refused."""
    renames = LEGACY_RENAMES.get(family)
    if renames is None:
        return dict(hf_state), False
    legacy = sorted(k for k in hf_state
                    if not _is_memory_key(k, family) and k.startswith(tuple(old for old, _ in renames)))
    memory = sorted(k for k in hf_state if k != LM_HEAD and _is_memory_key(k, family))
    if not legacy:
        return dict(hf_state), False
    if memory:
        raise LoongError(f"the checkpoint mixes two tensor layouts: {memory[0]!r} (in-memory names) and "
                         f"{legacy[0]!r} (the saved, legacy names)")
    out = {}
    for key, value in hf_state.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out, True


def file_key(key: str, family: str, legacy: bool) -> str:
    """One in-memory name -> its ``legacy`` file name (unchanged when not ``legacy``)."""
    for old, new in LEGACY_RENAMES.get(family, ()) if legacy else ():
        if key.startswith(new):
            return old + key[len(new):]
    return key


def to_file_layout(state: Mapping[str, Tensor], family: str, legacy: bool) -> dict[str, Tensor]:
    """In-memory names -> ``legacy`` file names (the inverse of :func:`to_memory_layout`)."""
    return {file_key(key, family, legacy): value for key, value in state.items()}


def layout_of(hf_state: Mapping[str, Tensor], parts: VLMParts) -> HFLayout:
    """The layout ``hf_state`` is in (to write a state back the way it came)."""
    state, legacy = to_memory_layout(hf_state, parts.model.family)
    fnd = parts.foundation
    if fnd.is_moe and parts.model.family == "qwen3_vl_moe":
        return HFLayout(legacy, experts_layout_of(state, fnd))  # type: ignore[arg-type]
    return HFLayout(legacy)


# --- tensors -----------------------------------------------------------------------------------------
def hf_to_native(hf_state: Mapping[str, Tensor], parts: VLMParts) -> dict[str, Tensor]:
    """A whole HF VLM state (either layout) -> the whole native state. Raises LoongError for missing, unexpected
    and (foundation) misshapen tensors."""
    fam = check_parts(parts, "reading a Hugging Face checkpoint")
    state, _ = to_memory_layout(hf_state, fam.name)
    module = vision_family(fam.encoder, fam.projector)
    vision_prefixes = VISION_PREFIXES[fam.name]
    vision = {k[len(module.hf_prefix):]: v for k, v in state.items() if k.startswith(vision_prefixes)}
    text = {k: v for k, v in state.items() if k.startswith(TEXT_PREFIX) or k == LM_HEAD}
    other = sorted(k for k in state if not k.startswith((*vision_prefixes, TEXT_PREFIX)) and k != LM_HEAD)
    if other:
        raise LoongError(f"{len(other)} tensors are not a {fam.architecture}'s, e.g. {other[:3]}")
    native = module.load().hf_to_native(vision, parts.encoder, parts.projector)
    native.update({FOUNDATION + k: v for k, v in text_hf_to_native(text, parts.foundation, TEXT_PREFIX).items()})
    return native


def native_to_hf(native: Mapping[str, Tensor], parts: VLMParts, layout: HFLayout | None = None) -> dict[str, Tensor]:
    """The whole native state -> the HF state in ``layout`` (default: :func:`canonical_layout`). Returned tensors
    may be views of ``native``'s."""
    fam = check_parts(parts, "writing a Hugging Face checkpoint")
    layout = layout or canonical_layout(fam.name)
    other = sorted(k for k in native if not k.startswith((*VISION_NATIVE, FOUNDATION)))
    if other:
        raise LoongError(f"{len(other)} tensors are not a VLM's (encoder.*, projector.*, foundation.*), "
                         f"e.g. {other[:3]}")
    module = vision_family(fam.encoder, fam.projector)
    vision = module.load().native_to_hf({k: v for k, v in native.items() if k.startswith(VISION_NATIVE)},
                                        parts.encoder, parts.projector)
    out = {module.hf_prefix + k: v for k, v in vision.items()}
    text = {k[len(FOUNDATION):]: v for k, v in native.items() if k.startswith(FOUNDATION)}
    out.update(text_native_to_hf(text, parts.foundation, TEXT_PREFIX, layout.experts))
    return to_file_layout(out, fam.name, layout.legacy)


def native_shapes(parts: VLMParts) -> dict[str, tuple[int, ...]]:
    """The whole-tensor shape of every native key of ``parts`` (the vision modules are built on the meta
    device: no memory, no time)."""
    module = vision_family(parts.encoder.family, parts.projector.family).load()
    with torch.device("meta"):
        encoder = module.build_encoder(parts.encoder)
        projector = module.build_projector(parts.projector, parts.encoder)
    out = {f"encoder.{k}": tuple(v.shape) for k, v in encoder.state_dict().items()}
    out.update({f"projector.{k}": tuple(v.shape) for k, v in projector.state_dict().items()})
    out.update({FOUNDATION + k: s for k, s in foundation_shapes(parts.foundation).items()})
    return out


# --- one native tensor at a time (what the converters stream) ---------------------------------------
class KeyMapping:
    """:func:`hf_to_native` / :func:`native_to_hf` one native tensor at a time, HF names in ``layout`` (default:
    :func:`canonical_layout`): a vision tensor is one HF tensor (InternVL's fused qkv: its q, k and v), a foundation
    tensor the HF tensors of all its layers (loong-llm's per-key mapping behind
    :func:`~loong.vlm.models.text_mapping.text_native_to_hf_key`: fused QKV, gate/up, Qwen3-VL-MoE's fused
    experts). Each key maps exactly as in the whole-state functions (a test holds them equal, every family)."""

    def __init__(self, parts: VLMParts, layout: HFLayout | None = None) -> None:
        fam = check_parts(parts, "mapping a Hugging Face checkpoint")
        self.parts, self.family = parts, fam.name
        self.layout = layout or canonical_layout(fam.name)
        vision = vision_family(fam.encoder, fam.projector)
        module = importlib.import_module(f"{vision.module}.mapping")  # the family's HF key rules
        key_rules = getattr(module, "key_rules", None)  # families with fused HF tensors (InternVL's q/k/v) have it
        rules, self._fused = (key_rules(parts.encoder, parts.projector) if key_rules is not None
                              else (module.rules(parts.encoder, parts.projector), {}))
        self._rules = {r.native: r for r in rules}
        self._hf_prefix = vision.hf_prefix
        #: every native key's whole shape, in the order the converters go through them
        self.shapes = native_shapes(parts)

    def is_stacked(self, key: str) -> bool:
        """Whether native ``key`` stacks the foundation's layers on its leading axis."""
        return key.startswith(FOUNDATION) and foundation_is_stacked(key[len(FOUNDATION):])

    def _rule(self, key: str) -> Any:
        if key not in self._rules:
            raise LoongError(f"{key} is not a native tensor of a {self.family} model")
        return self._rules[key]

    def to_hf(self, key: str, tensor: Tensor) -> dict[str, Tensor]:
        """The HF tensors (file names) of native tensor ``key``; they may be views of ``tensor``."""
        if key.startswith(FOUNDATION):
            out = text_native_to_hf_key(key[len(FOUNDATION):], tensor, self.parts.foundation, TEXT_PREFIX,
                                        self.layout.experts)
        else:
            rule = self._rule(key)
            t, names = rule.to_hf(tensor), self._fused.get(rule.hf)
            # fused chunks are cloned: they would share one storage, which safetensors refuses to save
            out = ({self._hf_prefix + rule.hf: t} if names is None else
                   {self._hf_prefix + n: part.clone() for n, part in zip(names, t.chunk(len(names)), strict=True)})
        return {file_key(k, self.family, self.layout.legacy): v for k, v in out.items()}

    def to_native(self, key: str, take: Callable[[str], Tensor], layer: int | None = None) -> Tensor:
        """Native tensor ``key`` (a stacked one with ``layer``: that layer's slice) from the HF tensors
        ``take(file name)`` returns; only those it needs are asked for."""
        def memory_take(name: str) -> Tensor:
            return take(file_key(name, self.family, self.layout.legacy))

        if key.startswith(FOUNDATION):
            fnd = self.parts.foundation
            return foundation_hf_to_native_key(key[len(FOUNDATION):], text_taker(memory_take, fnd, TEXT_PREFIX), fnd,
                                               layer=layer)
        rule = self._rule(key)
        names = self._fused.get(rule.hf)
        t = (memory_take(self._hf_prefix + rule.hf) if names is None
             else torch.cat([memory_take(self._hf_prefix + n) for n in names]))
        return rule.to_native(t)


# --- folders -----------------------------------------------------------------------------------------
def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of an HF folder, with a one-line error when it is not one."""
    from loong.llm.hf import read_hf_config as read

    return read(path)


def parts_from_folder(path: str | Path, keep: VLMParts | None = None) -> VLMParts:
    """The four configs of an HF VLM folder (its config.json; the folder's name is the preset); ``keep`` donates
    the training fields (:func:`~loong.vlm.hf_config.parts_from_hf`)."""
    return parts_from_hf(read_hf_config(path), str(path), keep, preset=Path(path).name)


def has_processor(folder: str | Path) -> bool:
    """Whether ``folder`` holds a processor (its processor / preprocessor config)."""
    return any((Path(folder) / name).is_file() for name in PROCESSOR_CONFIGS)


def load_processor_folder(folder: str | Path) -> Any:
    """transformers' processor saved in ``folder`` (local files only), with a one-line error."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types for unreadable folders
        raise LoongError(f"cannot load a processor from {folder}: {exc}") from None


def adopt_init_from_hf(cfg: Any) -> None:
    """``model.init_from_hf=PATH``: the folder's config.json sets the shapes of all three components (as
    ``from_pretrained`` does; the run keeps its training fields), and, when ``data.processor`` is unset and the
    folder holds a processor, the data reads with it. Does nothing without ``init_from_hf``."""
    path = cfg.model.init_from_hf
    if path is None:
        return
    if cfg.model.family == "custom":
        raise LoongError("model.init_from_hf: model.family=custom has no Hugging Face class to read; leave "
                         "model.family unset (the folder names its family) or pick a preset of the folder's family")
    parts_from_folder(path, keep=VLMParts.of(cfg)).apply_to(cfg)
    if cfg.data.processor is None and has_processor(path):
        cfg.data.processor = str(path)


def read_hf_state(path: str | Path, parts: VLMParts) -> dict[str, Tensor]:
    """The whole native state of an HF VLM folder whose config gives ``parts`` (safetensors only)."""
    hf_config, state = read_hf_folder(path)
    _check_family(path, hf_config, parts)
    try:
        return hf_to_native(state, parts)
    except LoongError as err:
        raise LoongError(f"{path}: {err}") from None


def _check_family(path: str | Path, hf_config: Mapping[str, Any], parts: VLMParts) -> None:
    fam = family_of_hf_config(dict(hf_config), source=str(path))
    if fam.name != parts.model.family:
        raise LoongError(f"{path} is a {fam.architecture} checkpoint but model.family is {parts.model.family}")


def open_hf_folder(path: str | Path, parts: VLMParts) -> tuple[HFTensors, KeyMapping]:
    """An HF VLM folder whose config gives ``parts``, opened to be read one tensor at a time, and the mapping in
    the folder's layout. Every name and shape is checked from the safetensors headers first (the whole-state
    mapping run on meta tensors: no data read), with the errors :func:`read_hf_state` gives."""
    _check_family(path, read_hf_config(path), parts)
    hf = HFTensors(path)
    meta = LazyTensors(hf).meta()
    try:
        hf_to_native(meta, parts)
    except LoongError as err:
        raise LoongError(f"{path}: {err}") from None
    return hf, KeyMapping(parts, layout_of(meta, parts))


def load_hf_into(model_chunks: list[torch.nn.Module], path: str | Path, parts: VLMParts,
                 progress: bool = False) -> None:
    """Load an HF VLM folder's weights into this rank's chunks (each takes its own slices), streamed: one native
    tensor (a foundation tensor: one layer of it) is built at a time from the HF tensors it needs, each read once
    from the files. ``progress``: a progress bar on stderr."""
    fill_from_hf(model_chunks, *open_hf_folder(path, parts), progress=progress)


def fill_from_hf(model_chunks: list[torch.nn.Module], hf: HFTensors, mapping: KeyMapping,
                 progress: bool = False) -> None:
    """:func:`load_hf_into` from a folder :func:`open_hf_folder` opened."""
    with progress_bar(progress, "convert") as bar:
        task = bar.add_task("convert", total=sum(math.prod(s) for s in mapping.shapes.values()), name="")
        load_state_by_key(model_chunks, mapping.shapes, lambda key, layer: mapping.to_native(key, hf.get, layer),
                          mapping.is_stacked, progress=(bar, task))


def hf_config_json(parts: VLMParts, dtype: torch.dtype, processor: Any) -> dict[str, Any]:
    """The config.json an HF folder of ``parts`` in ``dtype`` is written with (token ids from ``processor``)."""
    if dtype not in DTYPE_NAMES:
        raise LoongError(f"dtype {dtype} cannot be written (float32, bfloat16 or float16)")
    return hf_config_of(parts, processor, DTYPE_NAMES[dtype])


def write_hf_tensors(get: Callable[[str], Tensor], parts: VLMParts, out_dir: str | Path, dtype: torch.dtype,
                     processor: Any, layout: HFLayout | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                     progress: bool = False) -> Path:
    """Write an HF folder of ``parts`` in ``dtype`` whose native tensors ``get(key)`` returns, one at a time: each
    is mapped, cast and queued in the shard writer before the next is asked for, so memory holds one native tensor
    (and its HF pieces) plus the shard being filled. config.json, generation_config.json and ``processor`` (a
    :class:`~loong.vlm.data.processors.VisionProcessor` or a transformers processor: its token ids go into the
    config) are written beside the safetensors (sharded with ``model.safetensors.index.json`` above
    ``max_shard_bytes``). ``progress``: a progress bar on stderr."""
    config = hf_config_json(parts, dtype, processor)
    mapping = KeyMapping(parts, layout)
    with progress_bar(progress, "convert") as bar:
        task = bar.add_task("convert", total=sum(math.prod(s) for s in mapping.shapes.values()), name="")
        writer = ShardWriter(out_dir, max_shard_bytes)
        for key in mapping.shapes:
            for name, tensor in mapping.to_hf(key, get(key)).items():
                bar.update(task, name=name)
                writer.add(name, tensor.to(dtype))  # cast one piece at a time: never a second copy of the model
                bar.advance(task, tensor.numel())
        writer.close()
    folder = write_hf_metadata(out_dir, config, generation_config=generation_config_of(config))
    getattr(processor, "hf", processor).save_pretrained(str(folder))
    return folder


def write_hf(native: Mapping[str, Tensor], parts: VLMParts, out_dir: str | Path, dtype: torch.dtype,
             processor: Any, layout: HFLayout | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
             progress: bool = False) -> Path:
    """Write the whole native state as an HF folder (:func:`write_hf_tensors` over ``native``; its names and
    shapes are checked first)."""
    hf_config_json(parts, dtype, processor)  # a bad dtype or processor is refused before the names
    native_to_hf({k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in native.items()}, parts, layout)
    return write_hf_tensors(native.__getitem__, parts, out_dir, dtype, processor, layout, max_shard_bytes, progress)


def export_model(model_chunks: list[torch.nn.Module], parts: VLMParts, out_dir: str | Path, processor: Any) -> Path:
    """Gather the model from every rank and write an HF folder on rank 0 (collective), in the parameters'
    dtype, with the processor beside it."""
    dtype = next(p for c in model_chunks for p in c.parameters()).dtype
    hf_config_of(parts, processor, DTYPE_NAMES.get(dtype, "float32"))  # every rank refuses a bad config alike
    full = gather_full_state(model_chunks)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_hf(full, parts, out_dir, dtype, processor)
    if dist.is_initialized():
        dist.barrier()
    return Path(out_dir)


__all__ = ["DTYPE_NAMES", "HFLayout", "LEGACY_RENAMES", "KeyMapping", "adopt_init_from_hf", "canonical_layout",
           "export_model", "file_key", "fill_from_hf", "has_processor", "hf_config_json", "hf_to_native", "layout_of",
           "load_hf_into", "load_processor_folder", "native_shapes", "native_to_hf", "open_hf_folder",
           "parts_from_folder", "read_hf_config", "read_hf_state", "to_file_layout", "to_memory_layout", "write_hf",
           "write_hf_tensors"]
