"""Position ids of one sample: M-RoPE ``[3, n]`` (temporal, height, width) for the Qwen families, 1-D ``[n]``
otherwise.

The rule is transformers 5.24's ``Qwen2_5_VLModel.get_rope_index`` / ``Qwen3VLModel.get_rope_index`` (the tests
compare against them), computed with numpy on one sample at a time so that packed samples restart at 0:

- the tokens form runs of one modality (``mm_token_type_ids``: 0 text, 1 image, 2 video); a text run of
  ``k`` tokens takes positions ``p..p+k-1`` in all three rows and advances ``p`` by ``k``;
- each image or video run takes the next grid ``(t, h, w)`` of its kind and, with ``m`` the spatial merge
  size, the ids ``(p + T(i), p + j, p + k)`` over the ``t × h/m × w/m`` merged patches in that order, then
  advances ``p`` by ``max(h, w) / m`` (not by the temporal extent: this is 5.24's rule for videos too);
- Qwen2.5-VL: a video's temporal ids are ``floor(i · tokens_per_second · second_per_grid_t)`` (float32, as
  the model computes them), an image's ``i`` (= 0);
- Qwen3-VL: a video is ``t`` runs of one frame each (its processor writes a timestamp as text before each
  frame), so every frame takes grid ``(1, h, w)`` and temporal id ``p``: time lives in the text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loong.core.errors import LoongError

#: position scheme -> what it is
ROPE_KINDS: dict[str, str] = {
    "mrope_qwen2_5": "Qwen2.5-VL M-RoPE: 3-D ids, video time scaled by second_per_grid_ts * tokens_per_second",
    "mrope_qwen3": "Qwen3-VL M-RoPE: 3-D ids, one grid per video frame, timestamps in the text",
    "1d": "one position per token (InternVL and foundations without M-RoPE)",
}
#: processor family -> its position scheme
FAMILY_ROPE = {"qwen2_5_vl": "mrope_qwen2_5", "qwen3_vl": "mrope_qwen3", "internvl": "1d"}


@dataclass(frozen=True)
class RopeScheme:
    """How a sample's position ids are made: ``kind`` (:data:`ROPE_KINDS`), the merge size of the patch
    grids, and Qwen2.5-VL's ``tokens_per_second`` (its ``vision_config.tokens_per_second``)."""

    kind: str = "1d"
    spatial_merge_size: int = 2
    tokens_per_second: float = 2.0

    @property
    def is_mrope(self) -> bool:
        return self.kind != "1d"


def scheme_for(family: str, merge_size: int, positions: str = "auto", tokens_per_second: float = 2.0) -> RopeScheme:
    """The scheme ``data.positions`` selects for a processor ``family``: ``auto`` (the family's: M-RoPE for
    the Qwen families, 1-D for InternVL), ``mrope`` or ``1d`` (a foundation without M-RoPE)."""
    if positions == "auto":
        kind = FAMILY_ROPE[family]
    elif positions == "mrope":
        if FAMILY_ROPE[family] == "1d":
            raise LoongError(f"data.positions=mrope: the {family} processor makes no patch grids; use auto or 1d")
        kind = FAMILY_ROPE[family]
    elif positions == "1d":
        kind = "1d"
    else:
        raise LoongError(f"data.positions: {positions!r} is not one of auto, mrope, 1d")
    if tokens_per_second <= 0:
        raise LoongError(f"tokens_per_second must be > 0, got {tokens_per_second}")
    return RopeScheme(kind, int(merge_size), float(tokens_per_second))


def _runs(mm_types: np.ndarray) -> list[tuple[int, int, int]]:
    """``(modality, start, end)`` of each run of equal modality."""
    if len(mm_types) == 0:
        return []
    cuts = np.flatnonzero(np.diff(mm_types)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(mm_types)]])
    return [(int(mm_types[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def _grid_ids(start: int, grid: np.ndarray, merge: int, interval: np.float32 | None) -> np.ndarray:
    """The ``[3, t*h*w/m²]`` ids of one grid whose first id is ``start``."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    temporal = np.arange(t, dtype=np.int64)
    if interval is not None:  # float32 product truncated towards zero, as torch's .long()
        temporal = (temporal.astype(np.float32) * interval).astype(np.int64)
    ids = np.empty((3, t, h, w), dtype=np.int64)
    ids[0] = temporal[:, None, None] + start
    ids[1] = np.arange(h, dtype=np.int64)[None, :, None] + start
    ids[2] = np.arange(w, dtype=np.int64)[None, None, :] + start
    return ids.reshape(3, -1)


def mrope_position_ids(mm_token_type_ids: np.ndarray, image_grid_thw: np.ndarray | None,
                       video_grid_thw: np.ndarray | None, second_per_grid_ts: np.ndarray | None = None, *,
                       spatial_merge_size: int = 2, tokens_per_second: float = 2.0,
                       qwen3: bool = False) -> np.ndarray:
    """M-RoPE ids ``[3, n]`` of one sample (see the module docstring); grids are ``[k, 3]`` in token order."""
    mm = np.asarray(mm_token_type_ids).astype(np.int64)
    images = iter(np.asarray(image_grid_thw).reshape(-1, 3)) if image_grid_thw is not None else iter(())
    videos_grid = np.asarray(video_grid_thw).reshape(-1, 3) if video_grid_thw is not None else np.zeros((0, 3))
    if qwen3:  # one (1, h, w) grid per frame
        videos_grid = np.repeat(videos_grid, videos_grid[:, 0].astype(np.int64), axis=0)
        videos_grid[:, 0] = 1
    videos = iter(videos_grid)
    seconds = iter(np.asarray(second_per_grid_ts, dtype=np.float32).reshape(-1)
                   if second_per_grid_ts is not None else ())
    out = np.empty((3, len(mm)), dtype=np.int64)
    pos = 0
    for modality, start, end in _runs(mm):
        if modality == 0:
            out[:, start:end] = np.arange(pos, pos + end - start, dtype=np.int64)
            pos += end - start
            continue
        grid = next(images if modality == 1 else videos, None)
        if grid is None:
            raise LoongError(f"a {'n image' if modality == 1 else ' video'} placeholder run at tokens "
                             f"{start}..{end} has no grid left")
        interval = None
        if modality == 2 and not qwen3:
            spg = next(seconds, np.float32(1.0))
            interval = np.float32(tokens_per_second) * np.float32(spg)
        ids = _grid_ids(pos, grid, spatial_merge_size, interval)
        if ids.shape[1] != end - start:
            raise LoongError(f"a placeholder run of {end - start} tokens (at {start}) does not match its grid "
                             f"{tuple(int(g) for g in grid)} ({ids.shape[1]} tokens at merge size "
                             f"{spatial_merge_size})")
        out[:, start:end] = ids
        pos += max(int(grid[1]), int(grid[2])) // spatial_merge_size
    return out


def position_ids(scheme: RopeScheme, mm_token_type_ids: np.ndarray, image_grid_thw: np.ndarray | None = None,
                 video_grid_thw: np.ndarray | None = None, second_per_grid_ts: np.ndarray | None = None
                 ) -> np.ndarray:
    """One sample's position ids under ``scheme``: ``[3, n]`` for M-RoPE, ``[n]`` for 1-D."""
    n = len(mm_token_type_ids)
    if not scheme.is_mrope:
        return np.arange(n, dtype=np.int64)
    return mrope_position_ids(mm_token_type_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                              spatial_merge_size=scheme.spatial_merge_size,
                              tokens_per_second=scheme.tokens_per_second, qwen3=scheme.kind == "mrope_qwen3")
