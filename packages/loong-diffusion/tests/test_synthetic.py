"""The synthetic moving-shapes set: deterministic, class-coded text, a blob that moves."""

from __future__ import annotations

import torch

from loong.diffusion.data.synthetic import MovingShapes


def _set(**changes: object) -> MovingShapes:
    sizes = {"num_clips": 16, "num_classes": 4, "channels": 3, "frames": 4, "height": 16, "width": 16,
             "text_len": 5, "text_dim": 8, "seed": 0, **changes}
    return MovingShapes(**sizes)


def test_clips_are_a_pure_function_of_seed_and_index() -> None:
    a, b = _set().clip(5), _set().clip(5)
    assert a["latents"].shape == (3, 4, 16, 16) and a["text"].shape == (5, 8)
    assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["text"], b["text"])
    assert torch.equal(_set().clip(5 + 16)["latents"], a["latents"])  # the index wraps over num_clips
    assert not torch.equal(_set(seed=1).clip(5)["latents"], a["latents"])


def test_text_names_the_class() -> None:
    s = _set()
    assert torch.equal(s.clip(1)["text"], s.clip(5)["text"])  # clips 1 and 5: class 1
    assert not torch.equal(s.clip(1)["text"], s.clip(2)["text"])


def test_the_blob_moves_with_its_class_velocity() -> None:
    s = _set()
    for clip in (1, 5):  # one class: the same displacement per frame from different starts
        blob = s.clip(clip)["latents"].abs().sum(0)  # [frames, h, w]
        peaks = [divmod(int(frame.argmax()), 16) for frame in blob]
        assert len(set(peaks)) > 1, "the blob stands still"
    one, other = (s.clip(c)["latents"].abs().sum(0) for c in (1, 5))
    assert not torch.equal(one, other)  # different starting points


def test_sizes_give_each_clip_one_of_several_latent_sizes() -> None:
    sizes = [(4, 16, 16), (2, 8, 8), (4, 8, 16)]
    mixed, one = _set(sizes=sizes), _set()
    assert {tuple(mixed.clip(i)["latents"].shape[1:]) for i in range(16)} == set(sizes)  # every size drawn
    assert all(tuple(mixed.clip(i)["latents"].shape[1:]) == mixed.size_of(i) for i in range(16))
    assert mixed.size_of(3) == mixed.size_of(3 + 16)  # a pure function of the clip
    assert torch.equal(mixed.clip(5)["text"], one.clip(5)["text"])  # the caption does not depend on the size
    # one size given as a list is the default set itself
    assert torch.equal(_set(sizes=[(4, 16, 16)]).clip(5)["latents"], one.clip(5)["latents"])
