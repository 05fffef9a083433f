"""Chat data in JSONL: OpenAI ``messages``, ShareGPT ``conversations`` and Alpaca records.

Every line becomes one conversation, a list of ``{"role": ..., "content": ...}`` with roles
``system``, ``user`` and ``assistant``. ``data.chat_format=auto`` detects the format per line from
its keys. A bad line raises a :class:`LoongError` naming ``file:line`` (``data.on_error=raise``)
or is skipped and counted by reason (``data.on_error=skip``).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loong.core.errors import LoongError

Message = dict[str, str]
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
FORMATS = ("messages", "sharegpt", "alpaca")


class ChatFormatError(ValueError):
    """A record that is not a usable conversation; ``kind`` names the reason for the counts."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Conversation:
    """One usable conversation and the (1-based) line of the file it came from."""

    line: int
    messages: list[Message]


@dataclass
class ReadStats:
    """What reading a chat file found: lines read, conversations kept, lines skipped by reason."""

    lines: int = 0
    conversations: int = 0
    formats: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)

    @property
    def skipped_lines(self) -> int:
        """Lines skipped under ``data.on_error=skip``."""
        return sum(self.skipped.values())


def detect_format(record: dict[str, Any]) -> str:
    """``messages``, ``sharegpt`` or ``alpaca`` from a record's keys."""
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record or "output" in record:
        return "alpaca"
    raise ChatFormatError(
        "unknown format",
        f"cannot tell the chat format (keys {sorted(record)}); expected 'messages' (OpenAI), "
        "'conversations' (ShareGPT) or 'instruction'/'output' (Alpaca)",
    )


def _text(value: Any, what: str) -> str:
    """A message's text: a string, or OpenAI content parts ``[{"type": "text", "text": ...}]``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise ChatFormatError("bad content", f"{what} is not a string (got {type(value).__name__})")


def _turns(record: dict[str, Any], key: str, role_key: str, text_key: str,
           roles: dict[str, str]) -> list[Message]:
    turns = record[key]
    if not isinstance(turns, list):
        raise ChatFormatError("bad field", f"'{key}' is not a list (got {type(turns).__name__})")
    out: list[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ChatFormatError("bad field", f"{key}[{i}] is not an object")
        for k in (role_key, text_key):
            if k not in turn:
                raise ChatFormatError("missing field", f"{key}[{i}] has no '{k}' field (found {sorted(turn)})")
        role = turn[role_key]
        if role not in roles:
            raise ChatFormatError(
                "unknown role", f"{key}[{i}].{role_key}={role!r} is not one of {sorted(roles)}"
            )
        out.append({"role": roles[role], "content": _text(turn[text_key], f"{key}[{i}].{text_key}")})
    return out


def _alpaca(record: dict[str, Any]) -> list[Message]:
    for k in ("instruction", "output"):
        if k not in record:
            raise ChatFormatError("missing field", f"Alpaca record has no '{k}' field (found {sorted(record)})")
    instruction = _text(record["instruction"], "'instruction'")
    extra = _text(record.get("input") or "", "'input'")
    out: list[Message] = []
    if record.get("system"):
        out.append({"role": "system", "content": _text(record["system"], "'system'")})
    out.append({"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction})
    out.append({"role": "assistant", "content": _text(record["output"], "'output'")})
    return out


def normalise(record: Any, fmt: str = "auto") -> tuple[list[Message], str]:
    """One JSON record as a conversation, and the format it was read as.

    Raises :class:`ChatFormatError` for a record that is not a conversation with an assistant turn.
    """
    if not isinstance(record, dict):
        raise ChatFormatError("not an object", f"expected a JSON object, got {type(record).__name__}")
    if fmt == "auto":
        fmt = detect_format(record)
    if fmt == "messages":
        if "messages" not in record:
            raise ChatFormatError("missing field", f"no 'messages' field (found {sorted(record)})")
        conversation = _turns(record, "messages", "role", "content", {r: r for r in ROLES})
    elif fmt == "sharegpt":
        if "conversations" not in record:
            raise ChatFormatError("missing field", f"no 'conversations' field (found {sorted(record)})")
        conversation = _turns(record, "conversations", "from", "value", SHAREGPT_ROLES)
    elif fmt == "alpaca":
        conversation = _alpaca(record)
    else:
        raise LoongError(f"data.chat_format: {fmt!r} is not one of ['auto', {', '.join(map(repr, FORMATS))}]")
    if not conversation:
        raise ChatFormatError("empty conversation", "the conversation is empty")
    if not any(m["role"] == "assistant" for m in conversation):
        raise ChatFormatError("no assistant turn", "the conversation has no assistant turn (nothing to learn)")
    return conversation, fmt


def read_conversations(path: Path, fmt: str = "auto", on_error: str = "raise"
                       ) -> tuple[list[Conversation], ReadStats]:
    """Every conversation of a JSONL chat file, in file order, and the read statistics."""
    if not path.exists():
        raise LoongError(f"data.path: {path} does not exist")
    if path.is_dir():
        raise LoongError(f"data.path: {path} is a directory; give a .jsonl chat file")
    stats = ReadStats()
    conversations: list[Conversation] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ChatFormatError("invalid JSON", f"not valid JSON ({exc.msg})") from None
                conversation, used = normalise(record, fmt)
            except ChatFormatError as exc:
                if on_error != "skip":
                    raise LoongError(f"{path}:{lineno}: {exc} (data.on_error=skip skips such lines)") from None
                stats.skipped[exc.kind] += 1
                continue
            conversations.append(Conversation(lineno, conversation))
            stats.formats[used] += 1
    stats.conversations = len(conversations)
    if not conversations:
        raise LoongError(f"data.path: {path} holds no usable conversation ({stats.lines} lines read)")
    return conversations, stats
