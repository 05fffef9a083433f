"""One conversation → token ids with the assistant mask, and its images/videos → the processor's pixel tensors.

Encoding has two halves, so that a dataset is planned once without decoding a pixel and decoded in
DataLoader workers:

- :func:`plan_sample` (setup): probes each media file's header (:mod:`.media`), predicts the processor's grid
  (:class:`~loong.vlm.data.processors.VisionProcessor`), renders the conversation with the chat template,
  and expands each placeholder with the HF processor's own ``replace_image_token`` / ``replace_video_token``
  and ``get_text_with_replacements``, so the text is token for token what ``processor(text=..., images=...)``
  makes: an image of grid ``(1, h, w)`` becomes ``h·w / merge²`` pads (what the Qwen merger produces),
  an InternVL image ``tiles · image_seq_length`` context tokens. The loss mask covers the assistant turns'
  text (content and end-of-turn marker), never a vision token.
- :func:`load_pixels` (worker): decodes the files and runs the HF processor on them, checking that the grids
  are those planned.

:func:`encode_conversation` does both for one conversation and returns every tensor (HF conventions:
``labels`` are ``input_ids`` with -100 outside the assistant tokens, not shifted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loong.core.errors import LoongError
from loong.llm.sft.formats import ChatFormatError, ReadStats
from loong.llm.sft.templates import assistant_spans
from loong.vlm.data.conversations import VisionConversation
from loong.vlm.data.media import (
    MediaError,
    VideoInfo,
    load_image,
    load_video_frames,
    probe_image,
    probe_video,
)
from loong.vlm.data.processors import VisionProcessor
from loong.vlm.data.rope_index import RopeScheme, position_ids

TEXT, IMAGE, VIDEO = 0, 1, 2


@dataclass
class MediaItem:
    """One image or video of a sample as planned: its file, grid and (videos) sampled frames.

    ``grid``: Qwen ``(t, h, w)`` patches (an image has ``t = 1``); InternVL ``(tiles, 1, 1)`` (a video: one tile
    a frame). ``span``: the ``[start, end)`` token range of its placeholder unit in the sample (with the
    ``<|vision_start|>``/``<|vision_end|>`` or ``<img>``/``</img>`` around it), which truncation never cuts.
    """

    kind: str
    path: str
    grid: tuple[int, int, int]
    num_tokens: int
    span: tuple[int, int] = (0, 0)
    frames: tuple[int, ...] = ()
    video: VideoInfo | None = None
    second_per_grid_t: float = 0.0


@dataclass
class EncodedSample:
    """A planned conversation: ``input_ids`` [n], ``assistant_mask`` [n] (True = the token is learned),
    ``mm_token_type_ids`` [n] (0 text, 1 image placeholder, 2 video placeholder), its media in token order,
    and where it came from (``source:line``)."""

    input_ids: np.ndarray
    assistant_mask: np.ndarray
    mm_token_type_ids: np.ndarray
    media: list[MediaItem] = field(default_factory=list)
    source: str = ""
    line: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    def grids(self, kind: str) -> np.ndarray:
        """``[k, 3]`` int64 grids of the sample's images (``kind="image"``) or videos, in token order."""
        rows = [m.grid for m in self.media if m.kind == kind]
        return np.asarray(rows, dtype=np.int64).reshape(-1, 3)

    @property
    def second_per_grid_ts(self) -> np.ndarray:
        return np.asarray([m.second_per_grid_t for m in self.media if m.kind == "video"], dtype=np.float32)

    def positions(self, scheme: RopeScheme) -> np.ndarray:
        """Position ids ``[3, n]`` (M-RoPE) or ``[n]`` of this sample alone."""
        return position_ids(scheme, self.mm_token_type_ids, self.grids("image"), self.grids("video"),
                            self.second_per_grid_ts)


def _plan_media(proc: VisionProcessor, kind: str, path: str) -> MediaItem:
    if kind == "image":
        grid = proc.image_grid(probe_image(path), path)
        per = proc.hf.image_seq_length if proc.family == "internvl" else None
        tokens = grid[0] * per if per else grid[0] * grid[1] * grid[2] // proc.merge_size ** 2
        return MediaItem("image", path, grid, int(tokens))
    info = probe_video(path)
    frames = proc.sample_frames(info, path)
    grid = proc.video_grid(info, len(frames), path)
    if proc.family == "internvl":
        tokens = grid[0] * proc.hf.image_seq_length
    else:
        tokens = grid[0] * grid[1] * grid[2] // proc.merge_size ** 2
    spg = proc.second_per_grid_t(info, len(frames)) if proc.family == "qwen2_5_vl" else 0.0
    return MediaItem("video", path, grid, int(tokens), frames=tuple(frames), video=info, second_per_grid_t=spg)


def _video_metadata(item: MediaItem) -> Any:
    from transformers.video_utils import VideoMetadata

    info = item.video
    assert info is not None
    return VideoMetadata(total_num_frames=info.total_frames, fps=info.fps, width=info.width, height=info.height,
                         duration=info.total_frames / info.fps, frames_indices=list(item.frames))


def _replacements(proc: VisionProcessor, media: list[MediaItem]) -> tuple[list[str], list[str]]:
    """The HF processor's expansion of each image and video placeholder, computed from the planned grids."""
    images = [m for m in media if m.kind == "image"]
    videos = [m for m in media if m.kind == "video"]
    hf = proc.hf
    if proc.family == "internvl":
        image_inputs: dict[str, Any] = {"num_patches": [m.grid[0] for m in images]}
        # the replacement reads only the frame count of each video's pixel tensor
        video_inputs: dict[str, Any] = {"pixel_values_videos": [np.empty((m.grid[0], 0)) for m in videos]}
    else:
        image_inputs = {"image_grid_thw": np.asarray([m.grid for m in images], dtype=np.int64).reshape(-1, 3)}
        video_inputs = {"video_grid_thw": np.asarray([m.grid for m in videos], dtype=np.int64).reshape(-1, 3),
                        "video_metadata": [_video_metadata(m) for m in videos]}
    return ([hf.replace_image_token(image_inputs, image_idx=i) for i in range(len(images))],
            [hf.replace_video_token(video_inputs, video_idx=i) for i in range(len(videos))])


def _shift(pos: int, offsets: list[dict[str, Any]]) -> int:
    """A character position of the rendered text in the expanded text."""
    return pos + sum(len(r["replacement"]) - (r["span"][1] - r["span"][0]) for r in offsets if r["span"][1] <= pos)


def plan_sample(proc: VisionProcessor, conversation: VisionConversation, source: str = "") -> EncodedSample:
    """Tokens, assistant mask and media plan of one conversation (no pixel decoded).

    Raises :class:`MediaError` for a missing or damaged file and
    :class:`~loong.llm.sft.formats.ChatFormatError` for a conversation the template cannot render.
    """
    media = [_plan_media(proc, kind, path) for kind, path in conversation.media]
    text, spans = assistant_spans(proc.tokenizer, proc.template, conversation.messages)
    hf = proc.hf
    image_token = hf.image_token
    video_token = getattr(hf, "video_token", None)
    counts = {"image": text.count(image_token), "video": text.count(video_token) if video_token else 0}
    for kind in ("image", "video"):
        want = sum(m.kind == kind for m in media)
        if counts[kind] != want:
            raise ChatFormatError("template error", f"chat template {proc.template.name} rendered {counts[kind]} "
                                                    f"{kind} placeholder(s) for {want} {kind}(s)")
    image_repl, video_repl = _replacements(proc, media)
    (expanded,), (offsets,) = hf.get_text_with_replacements([text], image_repl, video_repl)
    enc = proc.tokenizer(expanded, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    ends = np.asarray([e for _, e in enc["offset_mapping"]], dtype=np.int64)

    mm = np.zeros(len(ids), dtype=np.int8)
    in_unit = np.zeros(len(ids), dtype=bool)
    by_kind = {"image": iter([m for m in media if m.kind == "image"]),
               "video": iter([m for m in media if m.kind == "video"])}
    wrap_open = proc.tokenizer.convert_tokens_to_ids("<|vision_start|>") if proc.is_qwen else None
    wrap_close = proc.tokenizer.convert_tokens_to_ids("<|vision_end|>") if proc.is_qwen else None
    for r in offsets:
        item = next(by_kind[r["type"]])
        a, b = r["new_span"]
        tokens = np.flatnonzero((starts < b) & (ends > a))
        lo, hi = int(tokens[0]), int(tokens[-1]) + 1
        placeholder = proc.image_token_id if item.kind == "image" else proc.video_token_id
        inside = ids[lo:hi] == placeholder
        if int(inside.sum()) != item.num_tokens:
            raise LoongError(f"{item.path}: the tokenizer of {proc.source} makes {int(inside.sum())} placeholder "
                             f"tokens of the {item.num_tokens} its {item.kind} needs (is the placeholder a "
                             "special token?)")
        mm[lo:hi][inside] = IMAGE if item.kind == "image" else VIDEO
        if wrap_open is not None and lo > 0 and ids[lo - 1] == wrap_open:
            lo -= 1
        if wrap_close is not None and hi < len(ids) and ids[hi] == wrap_close:
            hi += 1
        item.span = (lo, hi)
        in_unit[lo:hi] = True
    learned = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        s, e = _shift(s, offsets), _shift(e, offsets)
        learned |= (starts < e) & (ends > s)
    learned &= ~in_unit
    return EncodedSample(ids, learned, mm, media, source, conversation.line)


def plan_all(proc: VisionProcessor, conversations: list[VisionConversation], source: Path | str,
             on_error: str, stats: ReadStats) -> list[EncodedSample]:
    """Every conversation planned; a bad media file or template failure raises with ``file:line: media path``
    or, with ``on_error="skip"``, is counted in ``stats.skipped`` by reason and left out."""
    out = []
    for conv in conversations:
        try:
            out.append(plan_sample(proc, conv, str(source)))
        except (MediaError, ChatFormatError) as exc:
            if on_error != "skip":
                raise LoongError(f"{source}:{conv.line}: {exc} (data.on_error=skip skips such samples)") from None
            stats.skipped[exc.kind] += 1
    return out


# --- pixels ----------------------------------------------------------------------------------------
def decode_media(item: MediaItem) -> Any:
    """The decoded file: a PIL image, or the sampled frames ``[T, H, W, 3]`` of a video."""
    if item.kind == "image":
        return load_image(item.path)
    return load_video_frames(item.path, list(item.frames))


def empty_pixels(proc: VisionProcessor) -> dict[str, torch.Tensor]:
    """The pixel tensors of a sample without media (zero rows, the right trailing shape)."""
    if proc.family == "internvl":
        h, w = proc.tile_size
        return {"pixel_values": torch.zeros(0, 3, h, w)}
    d = proc.patch_dim
    return {"pixel_values": torch.zeros(0, d), "image_grid_thw": torch.zeros(0, 3, dtype=torch.int64),
            "pixel_values_videos": torch.zeros(0, d), "video_grid_thw": torch.zeros(0, 3, dtype=torch.int64)}


def process_media(proc: VisionProcessor, items: list[MediaItem], decoded: list[Any]) -> dict[str, torch.Tensor]:
    """The HF processor's pixel tensors of decoded media (in order), checked against the planned grids.

    Qwen: ``pixel_values [patches, C·T·P·P]`` + ``image_grid_thw [k, 3]`` for the images,
    ``pixel_values_videos`` + ``video_grid_thw`` for the videos. InternVL: ``pixel_values [tiles, 3, H, W]``
    holding the images' tiles and the videos' frames in token order.
    """
    out = empty_pixels(proc)
    if not items:
        return out
    if proc.family == "internvl" and len(items) > 1:
        # one call a file: InternVLProcessor stacks its videos' frames, so clips of different lengths cannot
        # share a call
        parts = [process_media(proc, [m], [d]) for m, d in zip(items, decoded, strict=True)]
        return {"pixel_values": torch.cat([p["pixel_values"] for p in parts])}
    hf = proc.hf
    images = [d for m, d in zip(items, decoded, strict=True) if m.kind == "image"]
    videos = [d for m, d in zip(items, decoded, strict=True) if m.kind == "video"]
    text = "".join(hf.image_token if m.kind == "image" else hf.video_token for m in items)
    kwargs: dict[str, Any] = {"return_tensors": "pt"}
    if videos:
        kwargs["videos_kwargs"] = {"do_sample_frames": False}
        if proc.is_qwen:
            kwargs["video_metadata"] = [_video_metadata(m) for m in items if m.kind == "video"]
    try:
        got = hf(text=[text], images=images or None, videos=videos or None, **kwargs)
    except (ValueError, RuntimeError) as exc:
        raise MediaError("bad image" if images else "bad video", items[0].path,
                         f"the processor refused the media ({exc})") from None
    if proc.family == "internvl":
        tiles = sum(m.grid[0] for m in items)
        if got["pixel_values"].shape[0] != tiles:
            raise MediaError("bad image", items[0].path, f"decoded to {got['pixel_values'].shape[0]} tiles, "
                                                         f"planned {tiles}")
        out["pixel_values"] = got["pixel_values"].float()
        return out
    for kind, key, pixels in (("image", "image_grid_thw", "pixel_values"),
                              ("video", "video_grid_thw", "pixel_values_videos")):
        planned = [m for m in items if m.kind == kind]
        if not planned:
            continue
        grids = got[key].to(torch.int64)
        for item, grid in zip(planned, grids.tolist(), strict=True):
            if tuple(grid) != item.grid:
                raise MediaError(f"bad {kind}", item.path, f"decoded to grid {tuple(grid)}, planned {item.grid} "
                                                           "from its header")
        out[key] = grids
        out[pixels] = got[pixels].float()
    return out


def load_pixels(proc: VisionProcessor, items: list[MediaItem]) -> dict[str, torch.Tensor]:
    """Decode ``items`` and run the processor on them (see :func:`process_media`)."""
    return process_media(proc, items, [decode_media(m) for m in items])


def encode_conversation(proc: VisionProcessor, conversation: VisionConversation, scheme: RopeScheme,
                        source: str = "") -> dict[str, torch.Tensor]:
    """Everything of one conversation, HF style: ``input_ids``, ``labels`` (-100 outside the assistant
    tokens), ``assistant_mask``, ``mm_token_type_ids``, ``position_ids`` (``[3, n]`` or ``[n]``), the pixel
    tensors of :func:`process_media` and, for Qwen2.5-VL, ``second_per_grid_ts``."""
    sample = plan_sample(proc, conversation, source)
    ids = torch.from_numpy(sample.input_ids)
    mask = torch.from_numpy(sample.assistant_mask)
    out: dict[str, torch.Tensor] = {
        "input_ids": ids,
        "labels": torch.where(mask, ids, torch.full_like(ids, -100)),
        "assistant_mask": mask,
        "mm_token_type_ids": torch.from_numpy(sample.mm_token_type_ids.astype(np.int64)),
        "position_ids": torch.from_numpy(sample.positions(scheme)),
    }
    out.update(load_pixels(proc, sample.media))
    if proc.family == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.from_numpy(sample.second_per_grid_ts)
    return out
