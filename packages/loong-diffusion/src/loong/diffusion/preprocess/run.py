"""``loong-diffusion preprocess``: a JSONL manifest of videos / images and captions → training shards of VAE
latents and text embeddings (``data.source=shards data.path=OUT``).

Rows are processed in manifest order, one clip at a time (clips of different buckets have different shapes), and
committed ``shard_size`` clips at a time (:mod:`.writer`). A rerun into the same folder continues after the last
committed shard; new lines appended to the manifest since are processed too, so a growing manifest can be
preprocessed incrementally. ``on_error="fail"`` stops at the first bad row (``file:line: reason``) after
committing the clips before it, so that a rerun, once the row is fixed, starts at that row; ``"skip"`` records
the row and its reason in the shard's sidecar and carries on.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from loong.core.data import count_lines
from loong.core.errors import LoongError
from loong.diffusion.preprocess.buckets import DEFAULT_BUCKETS, parse_buckets
from loong.diffusion.preprocess.encode import DTYPES, Encoders
from loong.diffusion.preprocess.image_encoder import (
    CONDITIONS,
    Condition,
    ImageEncoder,
    condition_frames,
    condition_images,
    condition_pixels,
)
from loong.diffusion.preprocess.manifest import RowError, decode_line, open_manifest, read_lines
from loong.diffusion.preprocess.media import load_clip
from loong.diffusion.preprocess.writer import ShardWriter

ON_ERROR = ("fail", "skip")


def _manifest_prefix_sha256(manifest: Path, lines: int) -> tuple[str, Any]:
    """The SHA-256 of the manifest's first ``lines`` lines, and the hasher to continue it with."""
    h = hashlib.sha256()
    with manifest.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if number > lines:
                break
            h.update(raw)
    return h.hexdigest(), h


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]preprocess"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
        TextColumn("{task.fields[clips]:,} clips  {task.fields[rate]:.2f} clips/s  {task.fields[skipped]} skipped"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not enabled,
    )


def preprocess(manifest: str | Path, output: str | Path, *, vae: str | Path, text_encoder: str | Path,
               buckets: str = DEFAULT_BUCKETS, fps: float | None = None, text_len: int = 512, shard_size: int = 64,
               on_error: Literal["fail", "skip"] = "fail", device: str = "auto", dtype: str = "fp32",
               condition: Condition = "none", image_encoder: str | Path | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Preprocess ``manifest`` into ``output`` (see the module docstring); ``condition`` (``first`` |
    ``first_last``) also stores each clip's image-to-video condition latent, and ``image_encoder`` (a CLIP vision
    model folder) the CLIP features of its conditioning frames (:mod:`.image_encoder`). Returns the summary: ``clips``,
    ``videos``, ``images``, ``skipped`` and ``skipped_rows`` (``where``/``reason``, this and earlier runs),
    ``buckets`` (clips per bucket), ``new_clips`` (this run), ``shards``, ``seconds``, ``clips_per_s``, ``output``,
    ``resumed_at`` (the manifest line this run started after), ``condition`` and ``image`` (what the shards hold
    for image-to-video, as in the index)."""
    if on_error not in ON_ERROR:
        raise LoongError(f"--on-error: {on_error!r} is not one of {list(ON_ERROR)}")
    if shard_size < 1:
        raise LoongError(f"--shard-size must be >= 1, got {shard_size}")
    if fps is not None and fps <= 0:
        raise LoongError(f"--fps must be > 0, got {fps}")
    if condition not in CONDITIONS:
        raise LoongError(f"--condition: {condition!r} is not one of {list(CONDITIONS)}")
    if image_encoder is not None and condition == "none":
        raise LoongError("--image-encoder: CLIP features are of the conditioning frames; give --condition first "
                         "(Wan 2.1 I2V) or --condition first_last (Wan 2.1 FLF2V) with it")
    manifest = open_manifest(manifest)
    started = time.perf_counter()
    enc = Encoders(vae, text_encoder, device=device, dtype=dtype, text_len=text_len)
    parsed = parse_buckets(buckets, temporal=enc.temporal, spatial=enc.spatial)
    stills = [b.name for b in parsed if b.frames == 1]
    if condition == "first_last" and stills:
        raise LoongError(f"--condition first_last conditions a clip on its first and last frame, which a one-frame "
                         f"bucket does not have ({', '.join(stills)}); drop those from --buckets")
    clip_encoder = ImageEncoder(image_encoder, device=device, dtype=DTYPES[dtype]) if image_encoder else None
    options = {**enc.fingerprint, "buckets": [b.name for b in parsed], "fps": fps}
    if condition != "none":  # only then: a folder of today's options keeps today's index, and resumes
        options["condition"] = condition
    if clip_encoder is not None:
        options["image_encoder"] = clip_encoder.fingerprint
    # what the shards hold besides latents and text (the reader and the training checks read these)
    image = None if clip_encoder is None else {"images": condition_frames(condition), "tokens": clip_encoder.tokens,
                                               "dim": clip_encoder.dim}
    layout = {"latent_channels": enc.latent_channels, "text_dim": enc.text_dim,
              "vae_scale_factor": [enc.temporal, enc.spatial, enc.spatial], "condition": condition, "image": image,
              "manifest": str(manifest)}
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise LoongError(f"--output {out} is a file; give a folder")
    writer = ShardWriter(out, options)
    try:
        resumed_at = writer.lines_done
        digest, hasher = _manifest_prefix_sha256(manifest, resumed_at)
        if writer.manifest_sha256 is not None and digest != writer.manifest_sha256:
            raise LoongError(f"--output {out}: its shards cover the first {resumed_at} lines of a manifest that "
                             f"differs from {manifest}'s first {resumed_at} lines; rerun with the same manifest "
                             "(lines may only be appended), or write to a new folder")
        total = count_lines(manifest)
        samples: list[dict[str, Any]] = []
        tensors: dict[str, torch.Tensor] = {}
        skipped: list[dict[str, str]] = []
        line = resumed_at  # the last manifest line fully handled
        new_clips = 0

        def commit(last: int, sha: str) -> None:
            if last > writer.lines_done:
                writer.commit(samples, tensors, skipped, last, sha, layout)
            samples.clear()
            tensors.clear()
            skipped.clear()

        with _progress(progress) as bar:
            task = bar.add_task("preprocess", total=total, completed=resumed_at, clips=writer.totals()["clips"],
                                rate=0.0, skipped=writer.totals()["skipped"])
            try:
                for number, raw in read_lines(manifest, start=resumed_at):
                    before = hasher.copy()
                    hasher.update(raw)
                    try:
                        row = decode_line(raw, number, manifest)
                        if row is not None:
                            clip = load_clip(row, parsed, fps)
                            j = len(samples)
                            tensors[f"{j}.latents"] = enc.encode_video(clip.pixels)
                            tensors[f"{j}.text"] = enc.encode_text(row.caption)
                            if condition != "none":
                                tensors[f"{j}.condition"] = enc.encode_video(condition_pixels(clip.pixels,
                                                                                              condition))
                            if clip_encoder is not None:
                                tensors[f"{j}.image"] = clip_encoder.encode(condition_images(clip.pixels,
                                                                                             condition))
                            samples.append({
                                "line": number, "kind": row.kind, "source": row.source, "caption": row.caption,
                                "bucket": clip.bucket.name, "latent_shape": list(tensors[f"{j}.latents"].shape),
                                "text_tokens": int(tensors[f"{j}.text"].shape[0]),
                                "source_size": [clip.source_frames, clip.source_height, clip.source_width],
                                "frames": clip.frames_kept,
                            })
                            new_clips += 1
                    except RowError as exc:
                        if on_error == "fail":
                            commit(number - 1, before.hexdigest())  # a rerun starts at this row
                            kept = writer.totals()["clips"]
                            raise LoongError(f"{exc} (rerun after fixing it to continue; {kept} clips before it are "
                                             f"kept in {out}; --on-error skip skips such rows)") from None
                        skipped.append({"where": exc.where, "reason": exc.reason})
                    line = number
                    if len(samples) >= shard_size:
                        commit(line, hasher.hexdigest())
                    done = writer.totals()
                    bar.update(task, completed=number, clips=done["clips"] + len(samples),
                               skipped=done["skipped"] + len(skipped),
                               rate=new_clips / max(time.perf_counter() - started, 1e-9))
            except KeyboardInterrupt:
                commit(line, _manifest_prefix_sha256(manifest, line)[0])  # keep what is done; a rerun continues
                raise
            commit(line, hasher.hexdigest())
        totals = writer.totals()
        if not totals["clips"]:
            raise LoongError(f"{manifest}: no clips (an empty manifest, or every row skipped: "
                             + "; ".join(f"{s['where']}: {s['reason']}" for s in writer.skipped()[:3]) + ")")
        writer.write_index(complete=True, extra=layout)
        seconds = time.perf_counter() - started
        return {**totals, "skipped_rows": writer.skipped(), "new_clips": new_clips, "shards": writer.shards,
                "seconds": round(seconds, 3), "clips_per_s": round(new_clips / seconds, 3) if seconds else None,
                "output": str(out), "resumed_at": resumed_at, "condition": condition, "image": image}
    finally:
        writer.close()


__all__ = ["ON_ERROR", "preprocess"]
