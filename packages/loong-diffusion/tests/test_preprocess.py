"""``loong-diffusion preprocess`` end to end with tiny random VAE / UMT5 folders: the shards hold what diffusers'
``AutoencoderKLWan`` and ``WanPipeline``'s prompt encoding give for the same frames and captions (the frames
chosen and cut by hand from the documented bucket rule), bad rows fail with ``file:line`` or are skipped and
counted, and bad options fail before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from preprocess_testing import (
    decoded_frames,
    read_folder,
    reference_latents,
    run_cli,
    write_image,
    write_manifest,
    write_video,
)
from tiny_components import tiny_text_encoder_folder, tiny_vae_folder

from loong.diffusion.preprocess.buckets import Bucket, choose_bucket, parse_buckets

CAPTIONS = ["a red ball rolls across a green field", "two birds fly over the lake at night", "a cat"]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("preprocess_media")
    return {
        "root": d,
        "vae": tiny_vae_folder(d / "vae"),
        "vae48": tiny_vae_folder(d / "vae48", z_dim=48),
        "text": tiny_text_encoder_folder(d / "text"),
        # landscape, 12 frames at 8 fps; portrait, 20 frames at 16 fps; a portrait still
        "a": write_video(d / "a.mp4", 12, 40, 56, fps=8, seed=1),
        "b": write_video(d / "b.mp4", 20, 64, 40, fps=16, seed=2),
        "c": write_image(d / "c.png", 50, 40, seed=3),
        "square": write_video(d / "square.mp4", 6, 32, 32, fps=8, seed=4),
        "short": write_video(d / "short.mp4", 3, 40, 56, fps=8),
        "tiny": write_image(d / "tiny.png", 16, 16),
    }


def _preprocess(media: dict[str, Path], manifest: Path, out: Path, *extra: str, vae: str = "vae") -> tuple[int, str]:
    return run_cli("preprocess", str(manifest), "--output", str(out), "--vae", str(media[vae]),
                   "--text-encoder", str(media["text"]), "--no-progress", *extra)


@pytest.fixture(scope="module")
def processed(media: dict[str, Path]) -> tuple[Path, str]:
    manifest = write_manifest(media["root"] / "good.jsonl", [
        {"video": "a.mp4", "caption": CAPTIONS[0]},
        "",
        {"video": str(media["b"]), "caption": CAPTIONS[1]},  # an absolute path
        {"image": "c.png", "caption": CAPTIONS[2]},
    ])
    out = media["root"] / "shards"
    rc, log = _preprocess(media, manifest, out, "--buckets", "9x32x48,5x48x32,1x32x32", "--fps", "8",
                          "--shard-size", "2", "--text-len", "16")
    assert rc == 0, log
    return out, log


def test_latents_equal_diffusers_vae_of_the_cut_frames(media: dict[str, Path], processed: tuple[Path, str]) -> None:
    out, _ = processed
    a, b, c = read_folder(out)
    # a: 40x56 (w/h 1.4), 12 frames at 8 fps (--fps 8: every frame) -> 9x32x48, the only bucket it fills; frames
    # (12 - 9) // 2 = 1 .. 9; cover size 34x48 (scale 48/56), crop rows 1..32
    assert (a["line"], a["bucket"], a["frames"]) == (1, "9x32x48", list(range(1, 10)))
    want = reference_latents(media["vae"], decoded_frames(media["a"])[1:10], (48, 34), (0, 1, 48, 33))
    assert a["latents"].shape == (16, 3, 4, 6)
    torch.testing.assert_close(a["latents"], want, rtol=1e-5, atol=1e-5)
    # b: 64x40, 20 frames at 16 fps read at 8 -> every 2nd, 10 usable -> 5x48x32; window start (10 - 5) // 2 = 2,
    # i.e. source frames 4, 6, ..., 12; cover size 51x32 (scale 32/40), crop rows 1..48
    assert (b["line"], b["bucket"], b["frames"]) == (3, "5x48x32", [4, 6, 8, 10, 12])
    frames = decoded_frames(media["b"])
    want = reference_latents(media["vae"], [frames[i] for i in (4, 6, 8, 10, 12)], (32, 51), (0, 1, 32, 49))
    torch.testing.assert_close(b["latents"], want, rtol=1e-5, atol=1e-5)
    # c: a 50x40 still -> 1x32x32; cover size 40x32, crop rows 4..35
    from PIL import Image

    want = reference_latents(media["vae"], [np.asarray(Image.open(media["c"]).convert("RGB"))], (32, 40),
                             (0, 4, 32, 36))
    assert (c["line"], c["bucket"], c["kind"]) == (4, "1x32x32", "image")
    torch.testing.assert_close(c["latents"], want, rtol=1e-5, atol=1e-5)


def test_text_equals_wan_pipeline_prompt_embeds(media: dict[str, Path], processed: tuple[Path, str]) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    from loong.diffusion.data.shards import LatentShards

    text = media["text"]
    pipe = WanPipeline(tokenizer=AutoTokenizer.from_pretrained(text / "tokenizer"),
                       text_encoder=UMT5EncoderModel.from_pretrained(text / "text_encoder").eval(),
                       transformer=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler())
    shards = LatentShards(processed[0], text_len=16)
    for i, caption in enumerate(CAPTIONS):
        with torch.no_grad():
            want = pipe._get_t5_prompt_embeds(caption, max_sequence_length=16, device=torch.device("cpu"))[0]
        got = shards.clip(i)["text"]
        assert got.shape == (16, 32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got[shards.records[i].text_tokens:].abs().sum() == 0  # zero padding, as the pipeline pads


def test_index_and_summary(processed: tuple[Path, str]) -> None:
    out, log = processed
    index = json.loads((out / "index.json").read_text())
    assert index["complete"] and index["clips"] == 3 and (index["videos"], index["images"]) == (2, 1)
    assert index["buckets"] == {"1x32x32": 1, "5x48x32": 1, "9x32x48": 1}
    assert (index["latent_channels"], index["text_dim"], index["shards"], index["lines"]) == (16, 32, 2, 4)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "index.json", "shard-00000.json", "shard-00000.safetensors", "shard-00001.json", "shard-00001.safetensors"]
    assert "clips: 3 (2 videos, 1 images; 3 new)" in log and "skipped: 0" in log
    assert f"data.source=shards data.path={out}" in log


def test_wan22_48_channel_vae(media: dict[str, Path]) -> None:
    manifest = write_manifest(media["root"] / "wan22.jsonl", [{"video": "square.mp4", "caption": "a car"},
                                                              {"image": "c.png", "caption": "a cat"}])
    out = media["root"] / "shards48"
    rc, log = _preprocess(media, manifest, out, "--buckets", "5x32x32,1x32x32", vae="vae48")
    assert rc == 0, log
    video, image = read_folder(out)
    assert video["latents"].shape == (48, 2, 2, 2) and image["latents"].shape == (48, 1, 2, 2)
    # 6 frames -> the middle 5 (start 0); 32x32 already
    want = reference_latents(media["vae48"], decoded_frames(media["square"])[:5], (32, 32), (0, 0, 32, 32))
    torch.testing.assert_close(video["latents"], want, rtol=1e-5, atol=1e-5)
    assert json.loads((out / "index.json").read_text())["vae_scale_factor"] == [4, 16, 16]


# --- bad rows -----------------------------------------------------------------------------------
BAD_ROWS = [  # (manifest line, what the error says)
    ('{"video": "a.mp4"', "not valid JSON"),
    ('{"video": "a.mp4"}', "no 'caption' field"),
    ('{"video": "a.mp4", "image": "c.png", "caption": "x"}', "exactly one of 'video' or 'image'"),
    ('{"video": "missing.mp4", "caption": "x"}', "video missing.mp4 not found"),
    ('{"video": "bogus.mp4", "caption": "x"}', "cannot decode video bogus.mp4"),
    ('{"image": "tiny.png", "caption": "x"}', "smaller than every bucket"),
    ('{"video": "short.mp4", "caption": "x"}', "too short for every video bucket"),
    ("[1, 2]", "expected a JSON object"),
    ('{"image": "c.png", "caption": 5}', "'caption' must be a string"),
    ('{"image": "bogus.mp4", "caption": "x"}', "cannot read image bogus.mp4"),
]


@pytest.fixture(scope="module")
def bad_manifest(media: dict[str, Path]) -> Path:
    (media["root"] / "bogus.mp4").write_text("not a video\n")
    good = [{"video": "a.mp4", "caption": "a red ball"}, {"image": "c.png", "caption": "a cat"}]
    return write_manifest(media["root"] / "bad.jsonl", [good[0], *(row for row, _ in BAD_ROWS), good[1]])


def test_skip_counts_and_reports_every_bad_row(media: dict[str, Path], bad_manifest: Path) -> None:
    out = media["root"] / "skipped"
    rc, log = _preprocess(media, bad_manifest, out, "--buckets", "9x32x48,1x32x32", "--on-error", "skip")
    assert rc == 0, log
    assert f"skipped: {len(BAD_ROWS)}" in log
    for line, (_, reason) in enumerate(BAD_ROWS, start=2):
        assert f"{bad_manifest}:{line}: " in log and reason in log, (line, reason, log)
    index = json.loads((out / "index.json").read_text())
    assert (index["clips"], index["skipped"]) == (2, len(BAD_ROWS))
    assert [c["line"] for c in read_folder(out)] == [1, len(BAD_ROWS) + 2]


@pytest.mark.parametrize("which", [0, 4, 6])
def test_fail_names_file_and_line(media: dict[str, Path], bad_manifest: Path, which: int) -> None:
    row, reason = BAD_ROWS[which]
    manifest = write_manifest(media["root"] / f"fail{which}.jsonl", [row])
    out = media["root"] / f"fail{which}"
    rc, log = _preprocess(media, manifest, out, "--buckets", "9x32x48,1x32x32")
    assert rc == 2, log
    assert f"error: {manifest}:1: " in log and reason in log and "--on-error skip" in log
    assert not out.exists()  # failed on its first row: nothing written


@pytest.mark.parametrize(("args", "message"), [
    (("--buckets", "8x32x48"), "frames must be 4k+1"),
    (("--buckets", "9x30x48"), "multiples of 8"),
    (("--buckets", "9x32"), "is not FRAMESxHEIGHTxWIDTH"),
    (("--vae", "/nonexistent/vae"), "--vae: /nonexistent/vae does not exist"),
    (("--shard-size", "0"), "--shard-size must be >= 1"),
])
def test_bad_options_fail_before_writing(media: dict[str, Path], processed: tuple[Path, str], args: tuple,
                                         message: str) -> None:
    out = media["root"] / "never"
    rc, log = _preprocess(media, media["root"] / "good.jsonl", out, *args)
    assert rc == 2 and message in log, log
    assert not out.exists()


def test_missing_manifest(media: dict[str, Path]) -> None:
    rc, log = _preprocess(media, media["root"] / "none.jsonl", media["root"] / "never")
    assert rc == 2 and "none.jsonl does not exist" in log, log


# --- the bucket rule ----------------------------------------------------------------------------
def test_bucket_choice_rule() -> None:
    buckets = parse_buckets("81x480x832,81x832x480,33x480x832,1x480x832,1x624x624")
    # nearest aspect ratio first; on a tie the most frames x pixels
    assert choose_bucket(buckets, 100, 720, 1280, is_image=False) == Bucket(81, 480, 832)
    assert choose_bucket(buckets, 50, 720, 1280, is_image=False) == Bucket(33, 480, 832)  # too short for 81
    assert choose_bucket(buckets, 100, 1280, 720, is_image=False) == Bucket(81, 832, 480)
    assert choose_bucket(buckets, 20, 720, 1280, is_image=False) is None  # shorter than every video bucket
    assert choose_bucket(buckets, 100, 400, 700, is_image=False) is None  # never upscaled
    assert choose_bucket(buckets, 1, 1000, 1000, is_image=True) == Bucket(1, 624, 624)
    assert choose_bucket(buckets, 1, 700, 1000, is_image=True) == Bucket(1, 480, 832)  # 1.43: nearer 1.73 than 1
