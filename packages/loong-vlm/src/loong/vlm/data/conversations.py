"""Image/video–text conversations in JSONL: OpenAI ``messages`` with content parts, and the LLaVA/ShareGPT form.

Every line becomes one conversation: a list of ``{"role": ..., "content": [part, ...]}`` with roles
``system``, ``user`` and ``assistant`` and parts

- ``{"type": "text", "text": str}``
- ``{"type": "image", "image": "/absolute/path.png"}``
- ``{"type": "video", "video": "/absolute/path.mp4"}``

Accepted on input:

- OpenAI messages: ``{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
  {"type": "text", "text": "What is this?"}]}, ...]}``. An image part may also name its file with ``path``,
  ``url`` or OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``; a video part with ``path`` or
  ``url``. String contents may hold ``<image>`` / ``<video>`` tags filled from top-level ``images`` /
  ``videos`` lists (LLaMA-Factory's form).
- LLaVA/ShareGPT: ``{"conversations": [{"from": "human", "value": "<image>\\nWhat is this?"}, {"from": "gpt",
  "value": "..."}], "image": "a.png"}`` (``image``/``images``/``video``/``videos``: a path or a list); the
  i-th ``<image>`` tag is the i-th image. One newline next to a tag is the tag's separator, not text, so
  both forms of the same conversation parse to the same parts.
- Alpaca records (text only), through loong-llm's reader.

Media paths are relative to ``media_root`` (default: the JSONL file's folder); ``file://`` is stripped and a
remote URL is refused (nothing is downloaded). Whether a file exists and decodes is checked when the sample
is planned (:mod:`.encode`), which reports ``file:line: media path``. A broken line raises a
:class:`LoongError` naming ``file:line`` (``data.on_error=raise``) or is skipped and counted by reason
(``data.on_error=skip``) in loong-llm's :class:`~loong.llm.sft.formats.ReadStats`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loong.core.errors import LoongError
from loong.llm.sft.formats import (
    ROLES,
    SHAREGPT_ROLES,
    ChatFormatError,
    ReadStats,
    detect_format,
)
from loong.llm.sft.formats import normalise as normalise_text

Part = dict[str, str]
VisionMessage = dict[str, Any]  # {"role": str, "content": list[Part]}
MEDIA_KINDS = ("image", "video")
TAG = re.compile(r"<(image|video)>")
FORMATS = ("messages", "sharegpt", "alpaca")


@dataclass
class VisionConversation:
    """One usable conversation, the (1-based) line of the file it came from, and its messages."""

    line: int
    messages: list[VisionMessage]

    @property
    def media(self) -> list[tuple[str, str]]:
        """``(kind, path)`` of every image and video, in the order they appear."""
        return [(p["type"], p[p["type"]]) for m in self.messages for p in m["content"] if p["type"] in MEDIA_KINDS]


def _resolve(ref: Any, root: Path, what: str) -> str:
    """A media reference as an absolute local path (relative ones from ``root``)."""
    if isinstance(ref, dict) and isinstance(ref.get("url"), str):  # OpenAI's image_url object
        ref = ref["url"]
    if not isinstance(ref, str) or not ref.strip():
        raise ChatFormatError("bad media", f"{what} is not a path (got {type(ref).__name__})")
    ref = ref.strip()
    if ref.startswith("file://"):
        ref = ref[len("file://"):]
    elif re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", ref) or ref.startswith("data:"):
        raise ChatFormatError("remote media", f"{what}={ref[:80]!r} is not a local file (nothing is downloaded)")
    path = Path(ref)
    return str(path if path.is_absolute() else (root / path))


def _media_list(record: dict[str, Any], kind: str, root: Path) -> list[str]:
    """The top-level ``image``/``images`` (or ``video``/``videos``) paths of a record."""
    refs: list[Any] = []
    for key in (kind, kind + "s"):
        value = record.get(key)
        if value is None:
            continue
        refs.extend(value if isinstance(value, list) else [value])
    return [_resolve(r, root, kind) for r in refs]


def _append_text(parts: list[Part], text: str) -> None:
    if not text:
        return
    if parts and parts[-1]["type"] == "text":
        parts[-1] = {"type": "text", "text": parts[-1]["text"] + text}
    else:
        parts.append({"type": "text", "text": text})


def _expand_tags(text: str, queues: dict[str, list[str]], what: str) -> list[Part]:
    """Parts of a string whose ``<image>``/``<video>`` tags take the next file of their kind."""
    parts: list[Part] = []
    pieces = TAG.split(text)  # [text, kind, text, kind, ..., text]
    for i in range(0, len(pieces), 2):
        segment = pieces[i]
        if i > 0 and segment.startswith("\n"):  # the newline after a tag separates it from the text
            segment = segment[1:]
        if i + 1 < len(pieces) and segment.endswith("\n"):  # and the one before a tag
            segment = segment[:-1]
        _append_text(parts, segment)
        if i + 1 < len(pieces):
            kind = pieces[i + 1]
            if not queues[kind]:
                raise ChatFormatError("media mismatch", f"{what} has more <{kind}> tags than the record has "
                                                        f"{kind}s")
            parts.append({"type": kind, kind: queues[kind].pop(0)})
    return parts


def _parts(content: Any, queues: dict[str, list[str]], root: Path, what: str) -> list[Part]:
    """A message's content as normalised parts."""
    if isinstance(content, str):
        return _expand_tags(content, queues, what)
    if not isinstance(content, list):
        raise ChatFormatError("bad content", f"{what} is neither a string nor a list of parts "
                                             f"(got {type(content).__name__})")
    parts: list[Part] = []
    for j, part in enumerate(content):
        where = f"{what}[{j}]"
        if not isinstance(part, dict) or "type" not in part:
            raise ChatFormatError("bad content", f"{where} is not a content part with a 'type'")
        kind = part["type"]
        if kind == "text":
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ChatFormatError("bad content", f"{where}.text is not a string")
            for sub in _expand_tags(text, queues, where):
                if sub["type"] == "text":
                    _append_text(parts, sub["text"])
                else:
                    parts.append(sub)
        elif kind in ("image", "image_url", "video"):
            media = "video" if kind == "video" else "image"
            keys = ("image_url",) if kind == "image_url" else (media, "path", "url")
            ref = next((part[k] for k in keys if k in part), None)
            if ref is None:
                raise ChatFormatError("bad media", f"{where} names no file (give '{keys[0]}')")
            parts.append({"type": media, media: _resolve(ref, root, f"{where}.{keys[0]}")})
        else:
            raise ChatFormatError("bad content", f"{where}.type={kind!r} is not one of text, image, image_url, video")
    return parts


def normalise(record: Any, root: Path, fmt: str = "auto") -> tuple[list[VisionMessage], str]:
    """One JSON record as a conversation of normalised parts, and the format it was read as."""
    if not isinstance(record, dict):
        raise ChatFormatError("not an object", f"expected a JSON object, got {type(record).__name__}")
    if fmt == "auto":
        fmt = detect_format(record)
    if fmt not in FORMATS:
        raise LoongError(f"data.chat_format: {fmt!r} is not one of ['auto', {', '.join(map(repr, FORMATS))}]")
    if fmt == "alpaca":
        messages, _ = normalise_text(record, "alpaca")
        return [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages], fmt
    key, role_key, text_key, roles = (("messages", "role", "content", {r: r for r in ROLES}) if fmt == "messages"
                                      else ("conversations", "from", "value", SHAREGPT_ROLES))
    turns = record.get(key)
    if not isinstance(turns, list):
        raise ChatFormatError("missing field" if turns is None else "bad field",
                              f"'{key}' is not a list (found keys {sorted(record)})")
    queues = {kind: _media_list(record, kind, root) for kind in MEDIA_KINDS}
    messages: list[VisionMessage] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ChatFormatError("bad field", f"{key}[{i}] is not an object")
        for k in (role_key, text_key):
            if k not in turn:
                raise ChatFormatError("missing field", f"{key}[{i}] has no '{k}' field (found {sorted(turn)})")
        if turn[role_key] not in roles:
            raise ChatFormatError("unknown role", f"{key}[{i}].{role_key}={turn[role_key]!r} is not one of "
                                                  f"{sorted(roles)}")
        parts = _parts(turn[text_key], queues, root, f"{key}[{i}].{text_key}")
        messages.append({"role": roles[turn[role_key]], "content": parts})
    left = {kind: len(q) for kind, q in queues.items() if q}
    if left:
        raise ChatFormatError("media mismatch", "the record lists more media than its text has tags for: "
                                                + ", ".join(f"{n} {kind}(s) without a <{kind}> tag"
                                                            for kind, n in left.items()))
    if not messages:
        raise ChatFormatError("empty conversation", "the conversation is empty")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatFormatError("no assistant turn", "the conversation has no assistant turn (nothing to learn)")
    return messages, fmt


def read_vision_conversations(path: Path, fmt: str = "auto", on_error: str = "raise",
                              media_root: Path | None = None) -> tuple[list[VisionConversation], ReadStats]:
    """Every conversation of a JSONL file, in file order, and the read statistics."""
    path = Path(path)
    if not path.exists():
        raise LoongError(f"data.path: {path} does not exist")
    if path.is_dir():
        raise LoongError(f"data.path: {path} is a directory; give a .jsonl conversations file")
    root = Path(media_root) if media_root is not None else path.parent
    stats = ReadStats()
    conversations: list[VisionConversation] = []
    with path.open("rb") as fh:  # bytes: a bad byte is a bad line (file:line, skippable), not a decoder traceback
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                try:
                    record = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise ChatFormatError("invalid UTF-8", f"not valid UTF-8 ({exc.reason})") from None
                except json.JSONDecodeError as exc:
                    raise ChatFormatError("invalid JSON", f"not valid JSON ({exc.msg})") from None
                messages, used = normalise(record, root, fmt)
            except ChatFormatError as exc:
                if on_error != "skip":
                    raise LoongError(f"{path}:{lineno}: {exc} (data.on_error=skip skips such lines)") from None
                stats.skipped[exc.kind] += 1
                continue
            conversations.append(VisionConversation(lineno, messages))
            stats.formats[used] += 1
    stats.conversations = len(conversations)
    if not conversations:
        raise LoongError(f"data.path: {path} holds no usable conversation ({stats.lines} lines read)")
    return conversations, stats
