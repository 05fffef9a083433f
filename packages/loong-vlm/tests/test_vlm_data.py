"""The VLM data side: JSONL forms, placeholder expansion and pixels against the HF processors, M-RoPE against
HF's get_rope_index, packing, truncation, bad media, the synthetic set and the tiny processor folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from loong.core.errors import LoongError
from loong.vlm.data.conversations import VisionConversation, read_vision_conversations
from loong.vlm.data.dataset import collate_vision, prepare_vision_data, vision_loader
from loong.vlm.data.encode import encode_conversation, load_pixels, plan_sample
from loong.vlm.data.media import ImageInfo
from loong.vlm.data.packing import fit_samples, truncate_sample
from loong.vlm.data.processors import build_tiny_processor, ensure_tiny_processor, load_processor
from loong.vlm.data.rope_index import RopeScheme, scheme_for
from loong.vlm.data.synthetic import BACKGROUND, COLOURS, ensure_synthetic, write_synthetic

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")
TOKENS_PER_SECOND = 4  # not the default 2, so the test sees the factor
FPS = 3.0  # of a 16-frame, 8 fps clip: a non-integer temporal spacing for Qwen2.5-VL


# --- assets ------------------------------------------------------------------------------------------
def _png(path: Path, width: int, height: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def _video(path: Path, frames: int = 16, fps: int = 8, width: int = 48, height: int = 64) -> Path:
    container = av.open(str(path), "w")
    stream = container.add_stream("mpeg4", rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    for i in range(frames):
        frame = np.zeros((height, width, 3), np.uint8)
        frame[:, : (i + 1) * width // frames] = (10 * i, 255 - 10 * i, 128)
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return path


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    _png(d / "wide.png", 90, 60, 0)
    _png(d / "tall.png", 50, 120, 1)
    _png(d / "small.png", 40, 40, 2)
    _video(d / "clip.mp4")
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("processors")
    shapes = {"qwen2_5_vl": {}, "qwen3_vl": {"patch_size": 16, "video_max_pixels": 32 * 32 * 48},
              "internvl": {"image_size": 56, "max_tiles": 4}}
    return {f: build_tiny_processor(d / f, f, **shapes[f]) for f in FAMILIES}


def _proc(folders, family: str):
    return load_processor(folders[family], fps=FPS, max_frames=8)


def _scheme(proc) -> RopeScheme:
    return scheme_for(proc.family, proc.merge_size, tokens_per_second=TOKENS_PER_SECOND)


def _conversation(assets: Path, video: bool = True) -> VisionConversation:
    user = [{"type": "text", "text": "Compare "}, {"type": "image", "image": str(assets / "wide.png")},
            {"type": "text", "text": " with "}, {"type": "image", "image": str(assets / "tall.png")}]
    if video:
        user += [{"type": "text", "text": " and the clip "}, {"type": "video", "video": str(assets / "clip.mp4")}]
    return VisionConversation(1, [
        {"role": "system", "content": [{"type": "text", "text": "You describe pictures."}]},
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": "The first is wide, the second tall."}]},
        {"role": "user", "content": [{"type": "text", "text": "And colours?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Noisy ones."}]},
    ])


def _hf_reference(proc, conv: VisionConversation) -> dict:
    """What the HF processor itself makes of the conversation: its template rendering, its frame sampling."""
    hf = proc.hf
    text = hf.apply_chat_template(conv.messages, tokenize=False)
    images = [Image.open(p).convert("RGB") for k, p in conv.media if k == "image"]
    kwargs = {}
    videos = [p for k, p in conv.media if k == "video"]
    if videos:
        from transformers.video_utils import VideoMetadata

        with av.open(videos[0]) as c:
            stream = c.streams.video[0]
            frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
            meta = VideoMetadata(total_num_frames=len(frames), fps=float(stream.average_rate),
                                 width=stream.width, height=stream.height)
        kwargs = {"videos": [frames], "video_metadata": [meta],
                  "videos_kwargs": {"do_sample_frames": True, "fps": FPS}}
    return hf(text=[text], images=images, return_tensors="pt", **kwargs)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2], strict=True))


# --- conversations -------------------------------------------------------------------------------------
def test_both_jsonl_forms_parse_to_the_same_conversation(tmp_path):
    (tmp_path / "img").mkdir()
    openai = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": "img/a.png"}, {"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": "file://" + str(tmp_path / "b.png")}},
                                     {"type": "video", "video": "clip.mp4"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Two shapes and a clip."}]}]}
    llava = {"conversations": [{"from": "system", "value": "Be brief."},
                               {"from": "human", "value": "<image>\nWhat is this?\n<image><video>"},
                               {"from": "gpt", "value": "Two shapes and a clip."}],
             "image": ["img/a.png", str(tmp_path / "b.png")], "video": "clip.mp4"}
    factory = {"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "<image>What is this?<image>\n<video>"},
                            {"role": "assistant", "content": "Two shapes and a clip."}],
               "images": ["img/a.png", str(tmp_path / "b.png")], "videos": ["clip.mp4"]}
    path = _jsonl(tmp_path / "data.jsonl", [openai, llava, factory])
    convs, stats = read_vision_conversations(path)
    assert [c.line for c in convs] == [1, 2, 3]
    assert convs[0].messages == convs[1].messages == convs[2].messages
    assert convs[0].messages[1]["content"] == [
        {"type": "image", "image": str(tmp_path / "img/a.png")}, {"type": "text", "text": "What is this?"},
        {"type": "image", "image": str(tmp_path / "b.png")}, {"type": "video", "video": str(tmp_path / "clip.mp4")}]
    assert convs[0].media == [("image", str(tmp_path / "img/a.png")), ("image", str(tmp_path / "b.png")),
                              ("video", str(tmp_path / "clip.mp4"))]
    assert stats.formats == {"messages": 2, "sharegpt": 1}
    # media_root replaces the file's folder as the base of relative paths
    convs, _ = read_vision_conversations(path, media_root=tmp_path / "img")
    assert convs[1].media[0] == ("image", str(tmp_path / "img/img/a.png"))


def test_broken_lines_name_file_and_line_or_are_counted(tmp_path):
    good = {"conversations": [{"from": "human", "value": "<image>hi"}, {"from": "gpt", "value": "ok"}],
            "image": "a.png"}
    path = _jsonl(tmp_path / "d.jsonl", [
        good, "{not json", {"conversations": [{"from": "human", "value": "<image><image>"},
                                              {"from": "gpt", "value": "x"}], "image": "a.png"},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "https://example.com/a.png"}]},
                      {"role": "assistant", "content": "x"}]},
        {"conversations": [{"from": "human", "value": "no tag"}, {"from": "gpt", "value": "x"}], "image": "a.png"},
        {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                      {"role": "assistant", "content": "x"}]},
    ])
    with pytest.raises(LoongError, match=re.escape(f"{path}:2: not valid JSON")):
        read_vision_conversations(path)
    convs, stats = read_vision_conversations(path, on_error="skip")
    assert [c.line for c in convs] == [1]
    assert stats.skipped == {"invalid JSON": 1, "media mismatch": 2, "remote media": 1, "bad content": 1}


# --- expansion and pixels against the HF processor ------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_and_pixels_equal_the_hf_processor(folders, assets, family):
    proc = _proc(folders, family)
    conv = _conversation(assets)
    ours = encode_conversation(proc, conv, _scheme(proc))
    ref = _hf_reference(proc, conv)
    ids = ours["input_ids"].numpy()
    assert ids.tolist() == ref["input_ids"][0].tolist()
    torch.testing.assert_close(ours["pixel_values"], ref["pixel_values"].float(), rtol=0, atol=0)
    mm = ours["mm_token_type_ids"].numpy()
    if proc.is_qwen:
        assert ours["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist()
        assert ours["video_grid_thw"].tolist() == ref["video_grid_thw"].tolist()
        torch.testing.assert_close(ours["pixel_values_videos"], ref["pixel_values_videos"].float(), rtol=0, atol=0)
        assert mm.tolist() == ref["mm_token_type_ids"][0].tolist()
        # every image's placeholder run is what the merger makes of its grid: t*h*w / merge^2
        image_runs = [e - s for s, e in _runs(mm == 1)]
        assert image_runs == [int(g.prod()) // proc.merge_size ** 2 for g in ref["image_grid_thw"]]
        assert sum(ours["image_grid_thw"].prod(-1)).item() == ours["pixel_values"].shape[0]
        video_tokens = int((mm == 2).sum())
        assert video_tokens == int(ref["video_grid_thw"].prod()) // proc.merge_size ** 2
        if family == "qwen2_5_vl":
            torch.testing.assert_close(ours["second_per_grid_ts"], ref["second_per_grid_ts"].clone(),
                                       rtol=0, atol=0)
            assert len(_runs(mm == 2)) == 1
        else:  # a run per temporal patch, a timestamp before each
            assert len(_runs(mm == 2)) == int(ref["video_grid_thw"][0, 0])
            assert "<0.2 seconds>" in proc.tokenizer.decode(ids)
    else:
        seq = proc.hf.image_seq_length
        assert int((ids == proc.image_token_id).sum()) == ref["pixel_values"].shape[0] * seq  # seq tokens a tile
        tiles = [(e - s) // seq for s, e in _runs(mm == 1)]
        assert [t * seq for t in tiles] == [e - s for s, e in _runs(mm == 1)] and min(tiles) >= 3  # 2+ tiles, thumb
        assert int((mm == 2).sum()) == 6 * seq  # 6 frames sampled at 3 fps of a 2 s clip, a tile each
        assert ours["position_ids"].tolist() == list(range(len(ids)))
    # the loss covers the assistant turns' text and end marker, nothing else
    mask = ours["assistant_mask"].numpy()
    learned = [proc.tokenizer.decode(ids[s:e]) for s, e in _runs(mask)]
    assert learned == ["The first is wide, the second tall.<|im_end|>", "Noisy ones.<|im_end|>"]
    assert not (mask & (mm > 0)).any()
    assert (ours["labels"].numpy() == np.where(mask, ids, -100)).all()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_ids_equal_hf_get_rope_index(folders, assets, family):
    proc = _proc(folders, family)
    conv = _conversation(assets)
    ours = encode_conversation(proc, conv, _scheme(proc))
    ref = _hf_reference(proc, conv)
    text = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": proc.vocab_size,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16,
              "spatial_merge_size": proc.merge_size, "patch_size": proc.hf.image_processor.patch_size}
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

        config = Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "tokens_per_second": TOKENS_PER_SECOND,
                                                                   "fullatt_block_indexes": [0]})
        model = Qwen2_5_VLModel(config)
        extra = {"second_per_grid_ts": ref["second_per_grid_ts"].clone()}
    else:
        from transformers import Qwen3VLConfig, Qwen3VLModel

        model = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config={**vision, "deepstack_visual_indexes": []}))
        extra = {}
    hf_pos, _ = model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"],
                                     video_grid_thw=ref["video_grid_thw"], **extra)
    assert ours["position_ids"].shape == (3, len(ours["input_ids"]))
    assert torch.equal(ours["position_ids"], hf_pos[:, 0])
    video = ours["position_ids"][:, ours["mm_token_type_ids"] == 2]
    if family == "qwen2_5_vl":  # temporal ids spaced by tokens_per_second * second_per_grid_t = 4 * 2/3
        assert (video[0].unique() - video[0].min()).tolist() == [0, 2, 5]
    else:  # time is in the text: every frame's temporal id is its run's start
        assert len(video[0].unique()) == int(ref["video_grid_thw"][0, 0])


def test_vision_tokens_are_never_learned(folders, assets):
    proc = _proc(folders, "qwen2_5_vl")
    conv = VisionConversation(3, [
        {"role": "user", "content": [{"type": "text", "text": "Show me one."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Like this: "},
                                          {"type": "image", "image": str(assets / "small.png")},
                                          {"type": "text", "text": " a noisy square."}]}])
    sample = plan_sample(proc, conv)
    (item,) = sample.media
    mask = sample.assistant_mask
    lo, hi = item.span
    assert proc.tokenizer.decode(sample.input_ids[lo:hi]).startswith("<|vision_start|><|image_pad|>")
    assert proc.tokenizer.decode(sample.input_ids[lo:hi]).endswith("<|image_pad|><|vision_end|>")
    assert not mask[lo:hi].any()
    learned = [proc.tokenizer.decode(sample.input_ids[s:e]) for s, e in _runs(mask)]
    assert learned == ["Like this: ", " a noisy square.<|im_end|>"]


# --- packing and truncation ---------------------------------------------------------------------------
def test_packing_restarts_positions_and_numbers_documents(folders, assets):
    proc = _proc(folders, "qwen2_5_vl")
    scheme = _scheme(proc)
    small = VisionConversation(7, [
        {"role": "user", "content": [{"type": "image", "image": str(assets / "small.png")},
                                     {"type": "text", "text": "Name it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Noise."}]}])
    samples = [plan_sample(proc, c, "mem") for c in (_conversation(assets), small)]
    seq = len(samples[0]) + len(samples[1]) + 5
    from loong.vlm.data.dataset import VisionSFTDataset
    from loong.vlm.data.packing import PackedVisionSequences

    packed = PackedVisionSequences(samples, seq, packing=True, pad_id=proc.pad_id)
    assert packed.bins == [[0, 1]]
    batch = collate_vision([VisionSFTDataset(packed, proc, scheme)[0]])
    n0, n1 = len(samples[0]) - 1, len(samples[1]) - 1
    doc = batch["document_ids"][0]
    assert doc.tolist() == [0] * n0 + [1] * n1 + [-1] * (seq - n0 - n1)
    pos = batch["position_ids"][:, 0]
    assert pos.shape == (3, seq)
    for k, (start, n) in enumerate(((0, n0), (n0, n1))):
        alone = samples[k].positions(scheme)[:, :-1]
        assert pos[:, start : start + n].tolist() == alone.tolist()
        assert batch["tokens"][0, start : start + n].tolist() == samples[k].input_ids[:-1].tolist()
        assert batch["labels"][0, start : start + n].tolist() == samples[k].input_ids[1:].tolist()
        assert batch["loss_mask"][0, start : start + n].tolist() == samples[k].assistant_mask[1:].tolist()
    assert pos[:, n0].tolist() == [0, 0, 0]  # the second sample starts again at 0
    assert (pos[:, n0 + n1 :] == 0).all() and (batch["loss_mask"][0, n0 + n1 :] == 0).all()
    # media in token order: the first sample's images, then the second's
    pixels = [load_pixels(proc, s.media) for s in samples]
    assert torch.equal(batch["pixel_values"], torch.cat([p["pixel_values"] for p in pixels]))
    assert batch["image_grid_thw"].tolist() == [list(m.grid) for s in samples for m in s.media if m.kind == "image"]
    assert torch.equal(batch["pixel_values_videos"], pixels[0]["pixel_values_videos"])
    placeholders = int((batch["mm_token_type_ids"] == 1).sum())
    assert placeholders == int(batch["image_grid_thw"].prod(-1).sum()) // 4
    # unpacked: one sample a row, the same tokens
    unpacked = PackedVisionSequences(samples, seq, packing=False, pad_id=proc.pad_id)
    rows = collate_vision([VisionSFTDataset(unpacked, proc, scheme)[i] for i in range(2)])
    assert rows["position_ids"].shape == (3, 2, seq)
    assert rows["tokens"][1, :n1].tolist() == batch["tokens"][0, n0 : n0 + n1].tolist()
    assert (rows["document_ids"][1, :n1] == 0).all()


def test_truncation_never_cuts_an_image(folders, assets):
    proc = _proc(folders, "qwen2_5_vl")
    conv = _conversation(assets, video=False)
    conv.messages[1]["content"].insert(3, {"type": "text", "text": " (a long remark) " * 3})
    sample = plan_sample(proc, conv, "mem")
    first, second = sample.media
    inside_second = (second.span[0] + second.span[1]) // 2
    cut = truncate_sample(sample, inside_second)
    assert len(cut) == second.span[0] and cut.media == [first]
    assert int((cut.mm_token_type_ids == 1).sum()) == first.num_tokens  # only complete images left
    # fit: the over-long sample keeps its first image, the user's text after it, no assistant token: dropped
    kept, stats = fit_samples([sample], inside_second - 1, "truncate")
    assert (stats.truncated, stats.media_dropped, stats.dropped, kept) == (1, 1, 1, [])
    # a cut after the first assistant turn keeps both images and something to learn
    end_first_answer = int(np.flatnonzero(sample.assistant_mask)[5]) + 1
    kept, stats = fit_samples([sample], end_first_answer - 1, "truncate")
    assert (stats.truncated, stats.media_dropped, stats.dropped) == (1, 0, 0)
    assert len(kept[0]) == end_first_answer and len(kept[0].media) == 2
    kept, stats = fit_samples([sample], len(sample) - 2, "drop")
    assert (kept, stats.dropped, stats.truncated) == ([], 1, 0)
    kept, stats = fit_samples([sample], len(sample) - 1, "drop")  # fits exactly
    assert len(kept) == 1 and stats.dropped == 0
    with pytest.raises(LoongError, match="data.overlong"):
        fit_samples([sample], 10, "cut")


# --- bad media --------------------------------------------------------------------------------------------
def test_bad_media_name_file_line_and_path_or_are_skipped(folders, assets, tmp_path):
    proc = _proc(folders, "qwen2_5_vl")
    scheme = _scheme(proc)
    png = (assets / "wide.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(png[: len(png) // 2])
    (tmp_path / "text.png").write_text("this is not a picture")
    (tmp_path / "empty.mp4").write_bytes(b"")
    Image.open(assets / "wide.png").save(tmp_path / "cut.jpg")
    jpg = (tmp_path / "cut.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(jpg[: len(jpg) // 2])  # passes the header probe, fails to decode

    def rec(kind, name):
        return {"messages": [{"role": "user", "content": [{"type": kind, kind: name}, {"type": "text", "text": "?"}]},
                             {"role": "assistant", "content": "A picture."}]}

    records = [rec("image", str(assets / "wide.png")), rec("image", "missing.png"), rec("image", "truncated.png"),
               rec("image", "text.png"), rec("video", "empty.mp4"), rec("image", str(assets / "small.png"))]
    path = _jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(LoongError, match=re.escape(f"{path}:2: {tmp_path / 'missing.png'}: no such file")):
        prepare_vision_data(path, proc, scheme, 512)
    for line in (3, 4, 5):
        one = _jsonl(tmp_path / f"one{line}.jsonl", [records[line - 1]])
        name = records[line - 1]["messages"][0]["content"][0]
        media = tmp_path / name.get("image", name.get("video"))
        with pytest.raises(LoongError, match=re.escape(f"{one}:1: {media}: ")):
            prepare_vision_data(one, proc, scheme, 512)
    data = prepare_vision_data(path, proc, scheme, 512, on_error="skip", packing=False)
    assert data.read_stats.skipped == {"missing media": 1, "bad image": 2, "bad video": 1}
    assert [s.line for s in data.train.packed.samples] == [1, 6]
    assert "4 skipped (bad image: 2, bad video: 1, missing media: 1)" in data.summary(path)
    # a file that only a full decode finds damaged: in the worker, with file:line:path, or skipped
    path = _jsonl(tmp_path / "late.jsonl", [records[0], rec("image", "cut.jpg")])
    data = prepare_vision_data(path, proc, scheme, 1024, packing=True)
    with pytest.raises(LoongError, match=re.escape(f"{path}:2: {tmp_path / 'cut.jpg'}: cannot decode")):
        data.train[0]
    data = prepare_vision_data(path, proc, scheme, 1024, packing=True, on_error="skip")
    batch = collate_vision([data.train[0]])
    assert batch["skipped_samples"].item() == 1
    assert sorted(set(batch["document_ids"][0].tolist())) == [-1, 0]  # the broken sample is padding
    assert batch["image_grid_thw"].shape[0] == 1
    assert int((batch["mm_token_type_ids"] == 1).sum()) == int(batch["image_grid_thw"].prod()) // 4


# --- synthetic set ----------------------------------------------------------------------------------------
def _shape_of(mask: np.ndarray) -> str:
    """Circle, square or triangle from how much of its bounding box a shape fills."""
    ys, xs = np.nonzero(mask)
    fill = mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    return "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"


def test_synthetic_set_is_deterministic_and_its_captions_match_its_images(folders, tmp_path):
    a = write_synthetic(tmp_path / "a", size=40, seed=3)
    b = write_synthetic(tmp_path / "b", size=40, seed=3)
    c = write_synthetic(tmp_path / "c", size=40, seed=4)
    assert a.read_bytes() == b.read_bytes() and a.read_bytes() != c.read_bytes()
    assert all((tmp_path / "a/images" / p.name).read_bytes() == p.read_bytes()
               for p in sorted((tmp_path / "b/images").iterdir()))
    convs, _ = read_vision_conversations(a)
    sizes = set()
    for conv in convs:
        (_, image_path), = conv.media
        pixels = np.asarray(Image.open(image_path).convert("RGB"))
        sizes.add(pixels.shape[:2])
        found = []
        for name, rgb in COLOURS.items():
            mask = (pixels == rgb).all(-1)
            if mask.any():
                found.append((int(np.nonzero(mask)[1].min()), f"a {name} {_shape_of(mask)}"))
        palette = [BACKGROUND, *COLOURS.values()]  # no other colour: shapes are drawn without anti-aliasing
        assert np.logical_or.reduce([(pixels == rgb).all(-1) for rgb in palette]).all()
        names = [n for _, n in sorted(found)]
        expected = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        assert conv.messages[-1]["content"][0]["text"] == expected[0].upper() + expected[1:] + "."
    assert len(sizes) >= 4
    # several patch grids: dynamic resolution is exercised
    proc = _proc(folders, "qwen2_5_vl")
    grids = {plan_sample(proc, conv).media[0].grid for conv in convs}
    assert len(grids) >= 3
    # written once into a cache folder, then reused
    cached = ensure_synthetic(tmp_path / "cache", size=40, seed=3)
    stamp = cached.stat().st_mtime_ns
    assert ensure_synthetic(tmp_path / "cache", size=40, seed=3) == cached and cached.stat().st_mtime_ns == stamp
    assert cached.read_bytes() == a.read_bytes()


def test_synthetic_set_loads_through_workers(folders, tmp_path):
    proc = _proc(folders, "qwen3_vl")
    path = ensure_synthetic(tmp_path, size=12, seed=0)
    data = prepare_vision_data(path, proc, _scheme(proc), 128, valid_fraction=0.2)
    assert len(data.valid.packed.samples) == 2 and len(data.train.packed.samples) == 10
    order = [[i] for i in range(len(data.train))] + [[0, 1]]
    inline = list(vision_loader(data.train, order, num_workers=0))
    workers = list(vision_loader(data.train, order, num_workers=2))
    assert len(inline) == len(workers) == len(order)
    for x, y in zip(inline, workers, strict=True):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) for k in x)
    last = inline[-1]
    assert last["tokens"].shape == (2, 128) and last["position_ids"].shape == (3, 2, 128)
    assert last["pixel_values"].shape[1] == proc.patch_dim and last["pixel_values_videos"].shape == (0, proc.patch_dim)


# --- the tiny processor folder --------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_processor_loads_offline_and_round_trips(folders, tmp_path, monkeypatch, family):
    from transformers import AutoProcessor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = AutoProcessor.from_pretrained(str(folders[family]))
    assert type(hf).__name__ == {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
                                 "internvl": "InternVLProcessor"}[family]
    tok = hf.tokenizer
    specials = (["<img>", "</img>", "<IMG_CONTEXT>", "<video>"] if family == "internvl"
                else ["<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>"])
    for token in specials + ["<|im_start|>", "<|im_end|>"]:
        assert tok(token, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(token)]
    text = "A red circle and a blue triangle, 42 of them."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    hf.save_pretrained(str(tmp_path / "again"))
    again = AutoProcessor.from_pretrained(str(tmp_path / "again"))
    assert again.tokenizer.get_vocab() == tok.get_vocab()
    assert again.chat_template == hf.chat_template and again.chat_template
    assert again.image_processor.to_dict() == hf.image_processor.to_dict()
    assert again.video_processor.to_dict() == hf.video_processor.to_dict()
    if family == "internvl":
        assert again.image_seq_length == hf.image_seq_length == 4  # (56 / 14)^2 * 0.5^2
    # built deterministically, and once per shape in a cache
    first = ensure_tiny_processor(tmp_path / "cache", family, image_size=56)
    assert ensure_tiny_processor(tmp_path / "cache", family, image_size=56) == first
    assert json.loads((first / "tokenizer.json").read_text())["model"] == \
        json.loads((folders[family] / "tokenizer.json").read_text())["model"]


def test_processor_settings_are_checked(folders):
    proc = load_processor(folders["qwen2_5_vl"], min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 8)
    assert proc.image_grid(ImageInfo(200, 200)) == (1, 4, 4)  # at most 8 merged tokens: 2 x 2 of 2 x 2 patches
    with pytest.raises(LoongError, match="data.max_tiles"):
        load_processor(folders["qwen2_5_vl"], max_tiles=4)
    with pytest.raises(LoongError, match="data.min_pixels"):
        load_processor(folders["internvl"], min_pixels=100)
    with pytest.raises(LoongError, match="data.max_pixels=100 is below one merged patch"):
        load_processor(folders["qwen3_vl"], max_pixels=100, min_pixels=10)
    with pytest.raises(LoongError, match="data.chat_template"):
        load_processor(folders["qwen3_vl"], chat_template="qwen9")
    with pytest.raises(LoongError, match="data.processor"):
        load_processor(folders["qwen3_vl"] / "nope")


def test_text_only_samples_and_encoder_matched_processors(folders, tmp_path):
    from loong.vlm.data.processors import tiny_processor_shape
    from loong.vlm.models.config import EncoderConfig, ProjectorConfig

    text_only = VisionConversation(1, [{"role": "user", "content": [{"type": "text", "text": "Hello?"}]},
                                       {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]}])
    for family, trailing in (("qwen3_vl", (16 * 16 * 3 * 2,)), ("internvl", (3, 56, 56))):
        proc = _proc(folders, family)
        out = encode_conversation(proc, text_only, _scheme(proc))
        assert out["pixel_values"].shape == (0, *trailing)
        assert (out["mm_token_type_ids"] == 0).all()
        expected = torch.arange(len(out["input_ids"]))
        assert torch.equal(out["position_ids"], expected.expand(3, -1) if proc.is_qwen else expected)
    family, shape = tiny_processor_shape(EncoderConfig(family="qwen3_vit", patch_size=16))
    assert (family, shape) == ("qwen3_vl", {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2})
    family, shape = tiny_processor_shape(EncoderConfig(family="intern_vit", image_size=56),
                                         ProjectorConfig(family="internvl_mlp"))
    proc = load_processor(ensure_tiny_processor(tmp_path, family, **shape))
    assert proc.hf.image_seq_length == 4 and proc.tile_size == (56, 56)
    with pytest.raises(LoongError, match="encoder.family=siglip2"):
        tiny_processor_shape(EncoderConfig(family="siglip2"))


# --- balanced rows -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,multiple", [
    (["parallel.tp=3", "parallel.sequence_parallel=true"], 24),  # lcm(8, 3): multiples of 8 alone stopped megatron
    (["model=tiny_qwen3_vl_moe", "parallel.tp=3"], 24),  # a MoE foundation runs sequence-parallel at tp > 1
    (["parallel.tp=16", "parallel.sequence_parallel=true"], 16),
    (["parallel.tp=3"], 8),  # without sequence parallelism TP does not split the rows
])
def test_balanced_rows_split_over_the_foundations_sequence_parallelism(overrides: list[str], multiple: int) -> None:
    """Each balanced micro-batch's rows are trimmed to its longest row rounded up to a multiple of 8 and of what
    sequence parallelism splits every row into (no multi-process launch: the plan is the same on every rank)."""
    import random
    from types import SimpleNamespace

    from loong.core.config import compose_config
    from loong.llm.data.text import GlobalBatchSampler
    from loong.vlm.data.balance import BalancedVisionSamples
    from loong.vlm.data.encode import EncodedSample
    from loong.vlm.data.packing import PackedVisionSequences
    from loong.vlm.schema import VLMRunConfig

    seq = 240
    cfg, _ = compose_config("loong.vlm.configs", "train", [
        "data.balance.enabled=true", "data.packing=false", f"train.seq_length={seq}", "train.global_batch_size=8",
        "train.micro_batch_size=2", *overrides], VLMRunConfig)
    rng = random.Random(0)
    samples = [EncodedSample(np.arange(n), np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64))
               for n in (rng.randint(4, seq + 1) for _ in range(40))]  # text only: no media to decode
    packed = PackedVisionSequences(samples, seq, packing=False, pad_id=0)
    data = SimpleNamespace(packed=packed)
    balanced = BalancedVisionSamples(cfg, data, GlobalBatchSampler(len(packed), seed=0), dp_size=1, dp_group=None)
    assert balanced.row_multiple == multiple
    lengths = {length for step in range(4) for rows in balanced.rows(step, 0) for _, length in rows}
    assert all(n % multiple == 0 or n == seq for n in lengths) and min(lengths) < seq, lengths
