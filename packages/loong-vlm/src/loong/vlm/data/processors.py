"""Processors from local folders (transformers' ``AutoProcessor``), and the tiny processor built offline.

Three families are known, by the processor class the folder names:

=============  =========================  ==========================================================
family         HF processor               images / videos
=============  =========================  ==========================================================
``qwen2_5_vl`` ``Qwen2_5_VLProcessor``    Qwen2-VL image processor (dynamic resolution between
                                          ``min_pixels`` and ``max_pixels``), Qwen2-VL video processor
``qwen3_vl``   ``Qwen3VLProcessor``       Qwen2-VL image processor, Qwen3-VL video processor
                                          (timestamps in the text)
``internvl``   ``InternVLProcessor``      GOT-OCR2 image processor (dynamic tiling up to ``max_tiles``
                                          tiles + a thumbnail), InternVL video processor (a tile a frame)
=============  =========================  ==========================================================

Videos are sampled at ``fps`` frames per second (of video time), at most ``max_frames`` frames, with the
family's own sampling rule (:meth:`VisionProcessor.sample_frames`). :meth:`VisionProcessor.image_grid` and
:meth:`VisionProcessor.video_grid` predict from a file's header what the processor will make of it, so a
sample's tokens are planned without decoding its pixels.

:func:`build_tiny_processor` writes a processor folder of a family from what the packages ship: a byte-level
BPE trained on loong-llm's corpus plus the family's special tokens, the family's packaged chat template, and
the image/video processors at a given patch geometry. ``AutoProcessor.from_pretrained(folder)`` loads it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loong.core.errors import LoongError
from loong.llm.sft.templates import ChatTemplate
from loong.vlm.data.media import ImageInfo, MediaError, VideoInfo
from loong.vlm.data.templates import FAMILY_TEMPLATE, PACKAGED, resolve_vision_template

#: family -> HF processor class name
FAMILIES: dict[str, str] = {
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "internvl": "InternVLProcessor",
}
#: encoder family (``encoder.family``) -> the processor family that feeds it
PROCESSOR_FOR_ENCODER: dict[str, str] = {"qwen2_5_vit": "qwen2_5_vl", "qwen3_vit": "qwen3_vl", "intern_vit": "internvl"}
QWEN_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
INTERNVL_SPECIAL = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
CHAT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_BPE_SIZE = 512


def _family_of(hf: Any, source: str) -> str:
    name = type(hf).__name__
    for family, cls in FAMILIES.items():
        if name == cls:
            return family
    raise LoongError(f"data.processor: {source} holds a {name}; known processors are "
                     f"{', '.join(f'{c} ({f})' for f, c in FAMILIES.items())}")


@dataclass
class VisionProcessor:
    """A loaded HF processor and what the data side needs to know of it.

    ``hf`` is the transformers processor; ``family`` one of :data:`FAMILIES`; ``template`` the chat template
    conversations are rendered with; ``fps`` / ``max_frames`` the video sampling.
    """

    hf: Any
    family: str
    source: str
    template: ChatTemplate
    fps: float = 2.0
    max_frames: int = 32

    # --- tokens --------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.hf.tokenizer

    @property
    def vocab_size(self) -> int:
        """Tokens the embedding must hold (``len(tokenizer)``)."""
        return len(self.hf.tokenizer)

    @property
    def pad_id(self) -> int:
        tok = self.hf.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad is None:
            raise LoongError(f"data.processor: the tokenizer of {self.source} has neither a pad nor an eos token")
        return int(pad)

    @property
    def image_token_id(self) -> int:
        """The placeholder token an image's features replace (InternVL: ``<IMG_CONTEXT>``)."""
        return int(self.hf.image_token_id)

    @property
    def video_token_id(self) -> int:
        """The placeholder token a video's features replace (InternVL: frames are images, ``<IMG_CONTEXT>``)."""
        if self.family == "internvl":
            return self.image_token_id
        return int(self.hf.video_token_id)

    @property
    def is_qwen(self) -> bool:
        return self.family in ("qwen2_5_vl", "qwen3_vl")

    @property
    def merge_size(self) -> int:
        """Qwen: patches merged per side into one token (``spatial_merge_size``)."""
        return int(self.hf.image_processor.merge_size) if self.is_qwen else 1

    @property
    def temporal_patch_size(self) -> int:
        return int(self.hf.video_processor.temporal_patch_size) if self.is_qwen else 1

    @property
    def patch_dim(self) -> int:
        """Qwen: width of one flattened patch row of ``pixel_values`` (``C * T * P * P``)."""
        ip = self.hf.image_processor
        return 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2

    @property
    def tile_size(self) -> tuple[int, int]:
        """InternVL: ``(height, width)`` of a tile."""
        size = self.hf.image_processor.size
        return int(size.height), int(size.width)

    # --- planning from headers ---------------------------------------------------------------
    def image_grid(self, info: ImageInfo, path: str = "") -> tuple[int, int, int]:
        """Qwen: the image's patch grid ``(1, h, w)``; InternVL: ``(tiles, 1, 1)``."""
        ip = self.hf.image_processor
        if self.family == "internvl":
            kwargs = dict(getattr(type(self.hf), "images_kwargs", {}) or {})
            return (int(ip.get_number_of_image_patches(info.height, info.width, kwargs)), 1, 1)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = int(ip.patch_size) * int(ip.merge_size)
        try:
            h, w = smart_resize(info.height, info.width, factor=factor, min_pixels=int(ip.size.shortest_edge),
                                max_pixels=int(ip.size.longest_edge))
        except ValueError as exc:  # an aspect ratio over 200
            raise MediaError("bad image", path, str(exc)) from None
        return (1, h // int(ip.patch_size), w // int(ip.patch_size))

    def sample_frames(self, info: VideoInfo, path: str = "") -> list[int]:
        """Indices of the frames the family samples from a video at ``fps``, at most ``max_frames``."""
        from transformers.video_utils import VideoMetadata

        vp = self.hf.video_processor
        need = self.temporal_patch_size
        if info.total_frames < need:
            raise MediaError("bad video", path, f"has {info.total_frames} frame(s); the processor needs at least "
                                                f"{need}")
        metadata = VideoMetadata(total_num_frames=info.total_frames, fps=info.fps, width=info.width,
                                 height=info.height, duration=info.total_frames / info.fps)
        try:
            indices = [int(i) for i in vp.sample_frames(metadata, fps=self.fps)]
            if len(indices) > self.max_frames:  # InternVL's rule has no cap of its own
                indices = [int(i) for i in vp.sample_frames(metadata, num_frames=self.max_frames)]
        except (ValueError, ZeroDivisionError) as exc:
            raise MediaError("bad video", path, f"cannot sample frames at fps={self.fps} ({exc})") from None
        if not indices:
            raise MediaError("bad video", path, f"no frame is sampled at fps={self.fps}")
        return indices

    def video_grid(self, info: VideoInfo, num_frames: int, path: str = "") -> tuple[int, int, int]:
        """Qwen: the video's patch grid ``(t, h, w)`` for ``num_frames`` sampled frames; InternVL:
        ``(num_frames, 1, 1)`` (a tile a frame)."""
        if self.family == "internvl":
            return (num_frames, 1, 1)
        vp = self.hf.video_processor
        patch, tps = int(vp.patch_size), int(vp.temporal_patch_size)
        factor = patch * int(vp.merge_size)
        lo, hi = int(vp.size.shortest_edge), int(vp.size.longest_edge)
        cap = bool(vp.cap_pixels_per_frame)
        try:
            if self.family == "qwen2_5_vl":
                from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

                if cap:  # the per-frame share of the whole-video budget, as the processor's resize
                    total = int(vp.max_video_tokens * factor * factor * 0.9)
                    hi = max(min(hi, total * tps // num_frames), int(lo * 1.05))
                h, w = smart_resize(info.height, info.width, factor=factor, min_pixels=lo, max_pixels=hi)
            else:
                from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

                if cap:
                    per_frame = max(min(vp.max_video_tokens * factor * factor, hi // num_frames), int(lo * 1.05))
                    hi = per_frame * num_frames
                h, w = smart_resize(num_frames, info.height, info.width, temporal_factor=tps, factor=factor,
                                    min_pixels=lo, max_pixels=hi)
        except ValueError as exc:
            raise MediaError("bad video", path, str(exc)) from None
        return (math.ceil(num_frames / tps), h // patch, w // patch)

    def second_per_grid_t(self, info: VideoInfo, num_frames: int) -> float:
        """Seconds a temporal patch spans: ``temporal_patch_size / sampled fps`` (as Qwen2.5-VL's processor)."""
        sampled_fps = num_frames / info.total_frames * info.fps
        return self.temporal_patch_size / sampled_fps


def _set_sizes(proc: VisionProcessor, min_pixels: int | None, max_pixels: int | None,
               video_min_pixels: int | None, video_max_pixels: int | None, max_tiles: int | None) -> None:
    from transformers.image_utils import SizeDict

    if proc.family == "internvl":
        for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels),
                           ("video_min_pixels", video_min_pixels), ("video_max_pixels", video_max_pixels)):
            if value is not None:
                raise LoongError(f"data.{key}: InternVL tiles images at a fixed size; set data.max_tiles instead")
        if max_tiles is not None:
            if max_tiles < 1:
                raise LoongError(f"data.max_tiles: must be >= 1, got {max_tiles}")
            proc.hf.image_processor.max_patches = int(max_tiles)
        return
    if max_tiles is not None:
        raise LoongError("data.max_tiles: Qwen processors resize images instead of tiling them; "
                         "set data.min_pixels / data.max_pixels")
    for sub, lo, hi, prefix in ((proc.hf.image_processor, min_pixels, max_pixels, ""),
                                (proc.hf.video_processor, video_min_pixels, video_max_pixels, "video_")):
        lo = int(sub.size.shortest_edge) if lo is None else int(lo)
        hi = int(sub.size.longest_edge) if hi is None else int(hi)
        factor = int(sub.patch_size) * int(sub.merge_size)
        if lo < 1 or hi < lo:
            raise LoongError(f"data.{prefix}min_pixels / data.{prefix}max_pixels: need 1 <= min <= max, got "
                             f"{lo} and {hi}")
        if hi < factor * factor:
            raise LoongError(f"data.{prefix}max_pixels={hi} is below one merged patch ({factor}x{factor} pixels)")
        sub.size = SizeDict(shortest_edge=lo, longest_edge=hi)
    if proc.hf.video_processor.cap_pixels_per_frame is None:  # pin the processor's current (uncapped) rule
        proc.hf.video_processor.cap_pixels_per_frame = False


def load_processor(path: str | Path, *, chat_template: str = "auto", min_pixels: int | None = None,
                   max_pixels: int | None = None, video_min_pixels: int | None = None,
                   video_max_pixels: int | None = None, max_tiles: int | None = None, fps: float = 2.0,
                   max_frames: int = 32) -> VisionProcessor:
    """The processor in the local folder ``path`` (``data.processor``), with the data settings applied.

    ``min_pixels``/``max_pixels`` bound a Qwen image's resized area (None: the folder's values), the
    ``video_`` ones a video frame's; ``max_tiles`` caps InternVL's tiles; ``fps`` and ``max_frames`` set
    video sampling.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise LoongError(f"data.processor: {path} is not a folder")
    if fps <= 0:
        raise LoongError(f"data.fps: must be > 0, got {fps}")
    from transformers import AutoProcessor

    try:
        hf = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types for unreadable folders
        raise LoongError(f"data.processor: cannot load a processor from {path}: {exc}") from None
    family = _family_of(hf, str(folder))
    template = resolve_vision_template(chat_template, hf, family)
    proc = VisionProcessor(hf, family, str(folder), template, float(fps), int(max_frames))
    if max_frames < proc.temporal_patch_size:
        raise LoongError(f"data.max_frames: must be >= {proc.temporal_patch_size} (a temporal patch), "
                         f"got {max_frames}")
    _set_sizes(proc, min_pixels, max_pixels, video_min_pixels, video_max_pixels, max_tiles)
    if proc.is_qwen:
        proc.hf.video_processor.max_frames = int(max_frames)
    return proc


# --- the tiny processor ---------------------------------------------------------------------------
def _tiny_tokenizer(family: str):  # noqa: ANN202 (PreTrainedTokenizerFast)
    """A byte-level BPE trained on loong-llm's shipped corpus, with the family's special tokens first."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from loong.llm.data.tokenizer import packaged_corpus_path

    vision = INTERNVL_SPECIAL if family == "internvl" else QWEN_SPECIAL
    specials = CHAT_SPECIAL + vision
    texts = [json.loads(line)["text"] for line in packaged_corpus_path().read_text().splitlines()]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_BPE_SIZE + len(specials), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(texts, trainer=trainer)
    if family == "internvl":  # named so that InternVLProcessor finds them (tokenizer.start_image_token, ...)
        named = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                 "video_token": "<video>"}
    else:
        named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                 "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=named)


def build_tiny_processor(folder: str | Path, family: str = "qwen2_5_vl", *, patch_size: int = 14,
                         merge_size: int = 2, temporal_patch_size: int = 2, min_pixels: int = 28 * 28 * 4,
                         max_pixels: int = 28 * 28 * 64, video_min_pixels: int = 28 * 28 * 4,
                         video_max_pixels: int = 28 * 28 * 16, image_size: int = 56,
                         downsample_ratio: float = 0.5, max_tiles: int = 4) -> Path:
    """Write a tiny processor folder of ``family`` (offline, deterministic, about a second) and return it.

    Qwen: patches of ``patch_size`` (``temporal_patch_size`` frames), ``merge_size``² patches a token, images
    resized into ``[min_pixels, max_pixels]`` and video frames into the ``video_`` range. InternVL: tiles of
    ``image_size`` pixels, at most ``max_tiles`` (+ a thumbnail), ``(image_size / patch_size)² *
    downsample_ratio²`` tokens a tile. Match these to the encoder preset the processor feeds.
    """
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLProcessor,
        InternVLVideoProcessor,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    if family not in FAMILIES:
        raise LoongError(f"processor family {family!r} is not one of {', '.join(FAMILIES)}")
    folder = Path(folder)
    tokenizer = _tiny_tokenizer(family)
    template = PACKAGED[FAMILY_TEMPLATE[family]]
    if family == "internvl":
        seq = (image_size // patch_size) ** 2 * downsample_ratio ** 2
        if image_size % patch_size or seq != int(seq) or seq < 1:
            raise LoongError(f"InternVL tiles of {image_size} px with {patch_size} px patches and downsample "
                             f"{downsample_ratio} do not give a whole number of tokens a tile")
        size = {"height": image_size, "width": image_size}
        image = GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1, max_patches=max_tiles)
        video = InternVLVideoProcessor(size=size)
        processor = InternVLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video,
                                      image_seq_length=int(seq), chat_template=template)
    else:
        geometry = {"patch_size": patch_size, "merge_size": merge_size, "temporal_patch_size": temporal_patch_size}
        image = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, **geometry)
        video_cls = Qwen2VLVideoProcessor if family == "qwen2_5_vl" else Qwen3VLVideoProcessor
        video = video_cls(size={"shortest_edge": video_min_pixels, "longest_edge": video_max_pixels},
                          cap_pixels_per_frame=False, **geometry)
        cls = Qwen2_5_VLProcessor if family == "qwen2_5_vl" else Qwen3VLProcessor
        processor = cls(image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=template)
    folder.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(folder))
    return folder


def tiny_processor_shape(enc_cfg: Any, proj_cfg: Any = None) -> tuple[str, dict[str, Any]]:
    """The processor family and :func:`build_tiny_processor` keywords that match an encoder config
    (:class:`~loong.vlm.models.config.EncoderConfig`) and, for InternVL, its projector's ``downsample_ratio``."""
    family = PROCESSOR_FOR_ENCODER.get(enc_cfg.family)
    if family is None:
        raise LoongError(f"encoder.family={enc_cfg.family}: no packaged processor feeds it; set data.processor "
                         f"to a processor folder (known encoders: {', '.join(PROCESSOR_FOR_ENCODER)})")
    if family == "internvl":
        ratio = proj_cfg.downsample_ratio if proj_cfg is not None else 0.5
        return family, {"patch_size": enc_cfg.patch_size, "image_size": enc_cfg.image_size,
                        "downsample_ratio": ratio}
    return family, {"patch_size": enc_cfg.patch_size, "merge_size": enc_cfg.spatial_merge_size,
                    "temporal_patch_size": enc_cfg.temporal_patch_size}


def ensure_tiny_processor(cache_dir: str | Path, family: str = "qwen2_5_vl", **shape: Any) -> Path:
    """The tiny processor of ``family`` and ``shape`` (:func:`build_tiny_processor`'s keywords) under
    ``cache_dir``, built once: a folder named by a hash of the arguments, written to a temporary folder and
    renamed into place, so ranks that build it at the same time all end up reading one complete folder."""
    key = hashlib.sha256(json.dumps({"family": family, **shape}, sort_keys=True).encode()).hexdigest()[:12]
    target = Path(cache_dir) / f"tiny_processor_{family}_{key}"
    if (target / "processor_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_tiny_processor(tmp, family, **shape)
        try:
            os.rename(tmp, target)
        except OSError:  # another rank renamed its copy first
            if not (target / "processor_config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
