"""``loong-diffusion preprocess --condition first|first_last --image-encoder DIR``: the shards hold each clip's
condition latent and CLIP image features equal to what diffusers' ``WanImageToVideoPipeline`` computes from the
same frames with the same tiny components (``prepare_latents``, ``encode_image``); image-to-video presets train on
them through the CLI (I2V and FLF2V, packed too), and refuse shards that lack what they need."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from preprocess_testing import decoded_frames, read_folder, run_cli, write_manifest, write_video
from tiny_components import (
    TINY_IMAGE_DIM,
    TINY_IMAGE_TOKENS,
    tiny_image_encoder_folder,
    tiny_text_encoder_folder,
    tiny_vae_folder,
)

from loong.diffusion.data.shards import LatentShards

#: (file, height, width): both cut to the 5x32x32 bucket, the second by a centre crop of its width
VIDEOS = [("a.mp4", 32, 32), ("b.mp4", 32, 40)]
FLF2V = "model.pos_embed_seq_len=10"  # tiny_i2v with a two-image position table: first-last-frame


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("condition")
    rows = [{"video": write_video(d / name, 6, h, w, seed=i).name, "caption": f"a red ball rolls {i}"}
            for i, (name, h, w) in enumerate(VIDEOS)]
    s = {"root": d, "vae": tiny_vae_folder(d / "vae"), "text": tiny_text_encoder_folder(d / "text"),
         "clip": tiny_image_encoder_folder(d / "pipeline"), "manifest": write_manifest(d / "m.jsonl", rows)}
    for name, extra in [("first", ("--condition", "first", "--image-encoder", str(s["clip"]))),
                        ("first_last", ("--condition", "first_last", "--image-encoder", str(s["clip"]))),
                        ("no_image", ("--condition", "first")), ("plain", ())]:
        rc, log = _preprocess(s, d / name, "--shard-size", "1", *extra)
        assert rc == 0, log
        s[name] = d / name
    return s


def _preprocess(s: dict[str, Path], out: Path, *extra: str, buckets: str = "5x32x32") -> tuple[int, str]:
    return run_cli("preprocess", str(s["manifest"]), "--output", str(out), "--vae", str(s["vae"]),
                   "--text-encoder", str(s["text"]), "--buckets", buckets, "--no-progress", *extra)


def _cut(frame: np.ndarray) -> np.ndarray:
    """The bucket's centre crop of a 32-pixel-high frame to 32x32 (no resize: the height already fits)."""
    left = (frame.shape[1] - 32) // 2
    return frame[:, left:left + 32]


@pytest.mark.parametrize("condition", ["first", "first_last"])
def test_condition_and_image_features_equal_the_pipelines(setup: dict[str, Path], condition: str) -> None:
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPVisionModel

    vae = AutoencoderKLWan.from_pretrained(setup["vae"]).eval()
    latents_pipe = types.SimpleNamespace(vae=vae, vae_scale_factor_temporal=4, vae_scale_factor_spatial=8,
                                         config=types.SimpleNamespace(expand_timesteps=False))
    image_pipe = types.SimpleNamespace(
        image_processor=CLIPImageProcessor.from_pretrained(setup["clip"] / "image_processor"),
        image_encoder=CLIPVisionModel.from_pretrained(setup["clip"] / "image_encoder").eval())
    out = setup[condition]
    index = json.loads((out / "index.json").read_text())
    assert index["condition"] == condition
    images = 2 if condition == "first_last" else 1
    assert index["image"] == {"images": images, "tokens": TINY_IMAGE_TOKENS, "dim": TINY_IMAGE_DIM}
    reader = LatentShards(out, text_len=16)
    for i, ((name, _, _), stored) in enumerate(zip(VIDEOS, read_folder(out), strict=True)):
        assert stored["frames"] == [0, 1, 2, 3, 4]  # the middle 5 of 6
        frames = [_cut(f) for f in decoded_frames(setup["root"] / name)[:5]]
        pixels = [torch.from_numpy(f).permute(2, 0, 1)[None].float() / 127.5 - 1.0 for f in frames]
        with torch.no_grad():
            _, condition_in = WanImageToVideoPipeline.prepare_latents(
                latents_pipe, pixels[0], 1, 16, 32, 32, 5, torch.float32, torch.device("cpu"),
                torch.Generator().manual_seed(0), last_image=pixels[-1] if images == 2 else None)
            shown = [Image.fromarray(frames[0])] + ([Image.fromarray(frames[-1])] if images == 2 else [])
            embeds = WanImageToVideoPipeline.encode_image(image_pipe, shown if images == 2 else shown[0],
                                                          torch.device("cpu"))
        want_condition = condition_in[0, 4:]  # the pipeline's [mask, condition latent]
        assert want_condition.shape == stored["latents"].shape == (16, 2, 4, 4)
        clip = reader.clip(i)
        torch.testing.assert_close(clip["condition"], want_condition, rtol=1e-5, atol=1e-5)
        # the FLF2V transformer joins the pipeline's [images, tokens, dim] into one sequence of images · tokens
        assert embeds.shape == (images, TINY_IMAGE_TOKENS, TINY_IMAGE_DIM)
        torch.testing.assert_close(clip["image"], embeds.reshape(-1, TINY_IMAGE_DIM), rtol=1e-5, atol=1e-5)
        assert not torch.equal(clip["condition"], clip["latents"])  # the zero frames are encoded, not the clip's


def test_plain_shards_hold_no_condition(setup: dict[str, Path]) -> None:
    index = json.loads((setup["plain"] / "index.json").read_text())
    assert (index["condition"], index["image"]) == ("none", None)
    assert "condition" not in index["options"] and "image_encoder" not in index["options"]
    clip = LatentShards(setup["plain"], text_len=16).clip(0)
    assert set(clip) == {"latents", "text", "bucket"}
    no_image = LatentShards(setup["no_image"], text_len=16).clip(0)
    assert set(no_image) == {"latents", "text", "bucket", "condition"}


def _train(tmp_path: Path, out: Path, *overrides: str) -> tuple[int, str]:
    return run_cli("train", f"output_dir={tmp_path / 'runs'}", "run_name=i2v", "train.progress=false",
                   "model=tiny_i2v", "data.source=shards", f"data.path={out}", "data.text_len=16",
                   f"data.image_len={TINY_IMAGE_TOKENS}", "train.global_batch_size=2", "train.micro_batch_size=1",
                   "train.save_final=false", *overrides)


@pytest.mark.parametrize(("condition", "extra"), [
    ("first", ()), ("first_last", (FLF2V,)), ("first", ("data.pack_tokens=16",)),
], ids=["i2v", "flf2v", "i2v-packed"])
def test_image_to_video_trains_on_the_shards(setup: dict[str, Path], tmp_path: Path, condition: str,
                                             extra: tuple[str, ...]) -> None:
    rc, log = _train(tmp_path, setup[condition], "train.steps=2", *extra)
    assert rc == 0, log
    records = (tmp_path / "runs" / "i2v" / "metrics.jsonl").read_text().splitlines()
    losses = [r["train_loss"] for r in map(json.loads, records) if "train_loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)


@pytest.mark.parametrize(("folder", "overrides", "message"), [
    ("plain", (), "holds no condition latents"),
    ("plain", (), "--condition first --image-encoder"),
    ("first_last", (), "preprocessed with --condition first_last"),
    ("first", (FLF2V,), "preprocess with --condition first_last"),
    ("no_image", (), "holds no CLIP image features"),
    ("first", ("data.image_len=3",), f"set data.image_len={TINY_IMAGE_TOKENS}"),
    ("first", ("model.image_dim=16",), f"CLIP features of width {TINY_IMAGE_DIM}"),
])
def test_shards_without_the_condition_are_refused(setup: dict[str, Path], tmp_path: Path, folder: str,
                                                  overrides: tuple[str, ...], message: str) -> None:
    rc, log = _train(tmp_path, setup[folder], *overrides)
    assert rc == 2 and message in log and f"data.path={setup[folder]}" in log, log
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("extra", "buckets", "message"), [
    (("--image-encoder", "{clip}"), "5x32x32", "give --condition first"),
    (("--condition", "first_last"), "5x32x32,1x32x32", "a one-frame bucket"),
    (("--condition", "first", "--image-encoder", "{root}"), "5x32x32", "holds no CLIP image encoder"),
])
def test_bad_condition_options_are_refused(setup: dict[str, Path], extra: tuple[str, ...], buckets: str,
                                           message: str) -> None:
    out = setup["root"] / "refused"
    args = [a.format(clip=setup["clip"], root=setup["root"]) for a in extra]
    rc, log = _preprocess(setup, out, *args, buckets=buckets)
    assert rc == 2 and message in log, log
    assert not out.exists()


@pytest.mark.parametrize("extra", [("--condition", "first_last", "--image-encoder", "{clip}"),
                                   ("--condition", "first"), ()], ids=["other-condition", "no-image", "none"])
def test_resume_with_other_condition_options_is_refused(setup: dict[str, Path], extra: tuple[str, ...]) -> None:
    before = sorted(p.name for p in setup["first"].iterdir())
    rc, log = _preprocess(setup, setup["first"], *[a.format(clip=setup["clip"]) for a in extra])
    assert rc == 2 and "was made with other options" in log, log
    assert ("condition: was 'first'" in log) == (extra[:2] != ("--condition", "first")), log
    assert ("image_encoder: was" in log) == (len(extra) < 4), log
    assert sorted(p.name for p in setup["first"].iterdir()) == before
