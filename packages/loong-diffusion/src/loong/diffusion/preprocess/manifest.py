"""The preprocess manifest: JSONL, one sample a line, ``{"video": PATH, "caption": TEXT}`` or
``{"image": PATH, "caption": TEXT}`` (``PATH`` relative to the manifest's folder, or absolute).

Blank lines are allowed and ignored; anything else that is not such an object is a :class:`RowError` naming the
manifest's ``file:line``. Rows are read lazily, so a manifest of millions of lines costs no memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from loong.core.errors import LoongError

#: the media fields a row may hold (exactly one of them)
MEDIA_FIELDS = ("video", "image")


class RowError(LoongError):
    """A bad manifest row (or its media file): ``where`` is ``file:line``, ``reason`` what is wrong."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


@dataclass(frozen=True)
class Row:
    """One manifest row: its 1-based ``line``, ``kind`` (``video`` | ``image``), the resolved media ``path``, the
    ``source`` as written in the manifest, and the ``caption``."""

    line: int
    kind: Literal["video", "image"]
    path: Path
    source: str
    caption: str
    where: str

    def error(self, reason: str) -> RowError:
        """A :class:`RowError` at this row."""
        return RowError(self.where, reason)


def parse_row(text: str, line: int, manifest: Path) -> Row | None:
    """The row of one manifest line (None for a blank line); raises :class:`RowError`."""
    where = f"{manifest}:{line}"
    text = text.strip()
    if not text:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RowError(where, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise RowError(where, f"expected a JSON object like {{\"video\": \"clip.mp4\", \"caption\": \"...\"}}, "
                              f"got a {type(record).__name__}")
    media = [k for k in MEDIA_FIELDS if k in record]
    if len(media) != 1:
        found = "both 'video' and 'image'" if media else f"neither (keys: {sorted(record)})"
        raise RowError(where, f"a row needs exactly one of 'video' or 'image', found {found}")
    kind = media[0]
    source = record[kind]
    if not isinstance(source, str) or not source:
        raise RowError(where, f"field '{kind}' must be a non-empty path string, got {source!r}")
    if "caption" not in record:
        raise RowError(where, f"no 'caption' field (keys: {sorted(record)})")
    caption = record["caption"]
    if not isinstance(caption, str):
        raise RowError(where, f"field 'caption' must be a string, got {type(caption).__name__}")
    path = Path(source) if Path(source).is_absolute() else manifest.parent / source
    return Row(line=line, kind=kind, path=path, source=source, caption=caption, where=where)


def open_manifest(path: str | Path) -> Path:
    """``path`` as a manifest file, or a :class:`LoongError` saying why it is not one."""
    manifest = Path(path)
    if not manifest.exists():
        raise LoongError(f"manifest {manifest} does not exist")
    if not manifest.is_file():
        raise LoongError(f"manifest {manifest} is not a file (expected a JSONL file, one sample a line)")
    return manifest


def read_lines(manifest: Path, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw bytes)`` of every line after the first ``start`` lines (1-based numbers)."""
    with manifest.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if number > start:
                yield number, raw


def decode_line(raw: bytes, line: int, manifest: Path) -> Row | None:
    """:func:`parse_row` of raw bytes (bad UTF-8 is a :class:`RowError` too)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RowError(f"{manifest}:{line}", f"not valid UTF-8 ({exc.reason})") from None
    return parse_row(text, line, manifest)



__all__ = ["MEDIA_FIELDS", "Row", "RowError", "decode_line", "open_manifest", "parse_row",
           "read_lines"]
