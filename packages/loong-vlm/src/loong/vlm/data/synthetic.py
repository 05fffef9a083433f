"""The embedded default's data: small pictures of coloured shapes and captions that name them.

Each image is a light-grey canvas of one of :data:`IMAGE_SIZES` (so dynamic resolution gives several patch
grids) with one or two non-overlapping shapes (:data:`SHAPES` × :data:`COLOURS`, distinct colours, random
sizes and positions, drawn without anti-aliasing so every shape pixel is exactly its colour). The caption
names the shapes from left to right ("A red circle and a blue triangle."), so it can only be predicted from
the pixels. The set is an OpenAI-messages JSONL (``data.jsonl``) beside its PNGs, deterministic in
``(size, seed)``, and written once into a cache folder (:func:`ensure_synthetic`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from loong.core.errors import LoongError

SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
}
BACKGROUND = (235, 235, 235)
#: canvas sizes ``(width, height)``
IMAGE_SIZES = ((56, 56), (84, 56), (56, 84), (112, 84), (84, 112), (112, 112))
QUESTIONS = ("Describe the image.", "What shapes are in the picture?", "What do you see?")
VERSION = 1  # bump when the drawing or the captions change, so that caches are rebuilt


def _boxes(rng: random.Random, width: int, height: int, count: int) -> list[tuple[int, int, int, int]]:
    """``count`` non-overlapping square boxes ``(x0, y0, x1, y1)`` (exclusive ends) inside the canvas."""
    small = min(width, height)
    while True:
        boxes: list[tuple[int, int, int, int]] = []
        for _ in range(count):
            for _try in range(50):
                side = rng.randint(max(12, small // 4), max(12, small // 2))
                x0, y0 = rng.randint(0, width - side), rng.randint(0, height - side)
                box = (x0, y0, x0 + side, y0 + side)
                gap = 2  # keep shapes apart so each colour's pixels are one shape
                if all(box[2] + gap <= b[0] or b[2] + gap <= box[0] or box[3] + gap <= b[1] or b[3] + gap <= box[1]
                       for b in boxes):
                    boxes.append(box)
                    break
        if len(boxes) == count:
            return boxes


def draw_shape(draw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, int, int]) -> None:  # noqa: ANN001
    """Draw ``shape`` filling the square ``box`` (exclusive ends) on a PIL ``ImageDraw``."""
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=colour)
    elif shape == "square":
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=colour)
    else:  # an upright triangle: apex at the top middle
        draw.polygon([(x0, y1 - 1), (x1 - 1, y1 - 1), ((x0 + x1 - 1) / 2, y0)], fill=colour)


def caption(shapes: list[tuple[str, str]]) -> str:
    """``[(colour, shape), ...]`` (left to right) as a sentence."""
    names = [f"a {c} {s}" for c, s in shapes]
    text = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return text[0].upper() + text[1:] + "."


def write_synthetic(folder: Path | str, size: int = 256, seed: int = 0) -> Path:
    """Write ``size`` image–caption conversations into ``folder`` (``data.jsonl`` + ``images/*.png``)."""
    from PIL import Image, ImageDraw

    if size < 1:
        raise LoongError(f"data.synthetic.size: must be >= 1, got {size}")
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(size):
        width, height = rng.choice(IMAGE_SIZES)
        count = rng.choice((1, 1, 2))
        colours = rng.sample(sorted(COLOURS), count)
        shapes = [rng.choice(SHAPES) for _ in range(count)]
        boxes = _boxes(rng, width, height, count)
        image = Image.new("RGB", (width, height), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for shape, colour, box in zip(shapes, colours, boxes, strict=True):
            draw_shape(draw, shape, box, COLOURS[colour])
        name = f"images/{i:05d}.png"
        image.save(folder / name, format="PNG", optimize=False)
        order = sorted(range(count), key=lambda k: boxes[k][0])
        record = {"messages": [
            {"role": "user", "content": [{"type": "image", "image": name},
                                         {"type": "text", "text": rng.choice(QUESTIONS)}]},
            {"role": "assistant", "content": [{"type": "text",
                                               "text": caption([(colours[k], shapes[k]) for k in order])}]},
        ]}
        lines.append(json.dumps(record))
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ensure_synthetic(cache_dir: Path | str, size: int = 256, seed: int = 0) -> Path:
    """The synthetic set's JSONL under ``cache_dir``, written once (to a temporary folder renamed into
    place, so ranks writing it at the same time all read one complete copy)."""
    target = Path(cache_dir) / f"synthetic_shapes_v{VERSION}_n{size}_s{seed}"
    path = target / "data.jsonl"
    if path.is_file():
        return path
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_synthetic(tmp, size, seed)
        try:
            os.rename(tmp, target)
        except OSError:  # another rank renamed its copy first
            if not path.is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
