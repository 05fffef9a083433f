"""Chat templates: render a conversation, tokenise it, and mark the tokens the loss covers.

``data.chat_template`` chooses the template:

- ``auto``: the tokenizer's own Jinja template when it has one, else the packaged ``qwen`` (ChatML);
- ``tokenizer``: the tokenizer's own template (an error when it has none);
- ``llama3`` / ``qwen`` (alias ``chatml``): the packaged templates below, in the official formats;
- a path to a ``.jinja`` file.

The loss covers the assistant turns only: their content and end-of-turn marker (``<|eot_id|>``,
``<|im_end|>``), not the role headers nor the newline after the marker. A template with
``{% generation %}`` blocks gives the mask through ``apply_chat_template(...,
return_assistant_tokens_mask=True)``; for any other template the assistant spans are found by
rendering the conversation's prefixes turn by turn (which needs a prefix-consistent template).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loong.core.errors import LoongError, did_you_mean
from loong.llm.sft.formats import ChatFormatError, Message

LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
"""Llama 3 (Meta-Llama-3-*-Instruct): ``<|begin_of_text|>`` then, per message,
``<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>`` (content trimmed, as upstream)."""

QWEN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""Qwen / ChatML: per message ``<|im_start|>role\\ncontent<|im_end|>\\n`` (no default system prompt)."""

PACKAGED = {"llama3": LLAMA3_TEMPLATE, "qwen": QWEN_TEMPLATE, "chatml": QWEN_TEMPLATE}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and where it came from (``tokenizer``, a packaged name, or a file)."""

    name: str
    source: str

    @property
    def has_generation(self) -> bool:
        """Whether the template marks assistant output with ``{% generation %}`` blocks."""
        return bool(_GENERATION.search(self.source))


def _own_template(hf: Any) -> str | None:
    own = getattr(hf, "chat_template", None)
    if isinstance(own, dict):  # named templates: the default one
        own = own.get("default")
    return own if isinstance(own, str) and own.strip() else None


def resolve_template(name: str, hf: Any) -> ChatTemplate:
    """The template ``data.chat_template=name`` selects for the Hugging Face tokenizer ``hf``."""
    own = _own_template(hf)
    if name == "auto":
        return ChatTemplate("tokenizer", own) if own else ChatTemplate("qwen", QWEN_TEMPLATE)
    if name == "tokenizer":
        if own is None:
            raise LoongError("data.chat_template=tokenizer: the tokenizer has no chat template; "
                             "choose llama3 or qwen")
        return ChatTemplate("tokenizer", own)
    if name in PACKAGED:
        return ChatTemplate(name, PACKAGED[name])
    if name.endswith(".jinja"):
        path = Path(name)
        if not path.is_file():
            raise LoongError(f"data.chat_template: {name} does not exist")
        return ChatTemplate(str(path), path.read_text(encoding="utf-8"))
    raise LoongError(
        f"data.chat_template: unknown template {name!r}{did_you_mean(name, ['auto', 'tokenizer', *PACKAGED])} "
        "(choose auto, tokenizer, llama3, qwen, or a .jinja file)"
    )


def check_template_name(name: str) -> None:
    """Cheap validation of ``data.chat_template`` before anything is loaded."""
    if name in ("auto", "tokenizer", *PACKAGED):
        return
    if name.endswith(".jinja"):
        if not Path(name).is_file():
            raise LoongError(f"data.chat_template: {name} does not exist")
        return
    resolve_template(name, None)  # raises with the suggestions


def _render(hf: Any, template: ChatTemplate, messages: list[Message], prompt: bool) -> str:
    try:
        return hf.apply_chat_template(messages, chat_template=template.source, tokenize=False,
                                      add_generation_prompt=prompt)
    except Exception as exc:  # jinja raises TemplateError / raise_exception(...) of any kind
        raise ChatFormatError("template error", f"chat template {template.name}: {exc}") from None


def assistant_spans(hf: Any, template: ChatTemplate, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns, by prefixes.

    A span runs from the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
    ``render(messages[:i + 1])`` without trailing whitespace: the content and end-of-turn marker.
    """
    full = _render(hf, template, messages, False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(hf, template, messages[:i], True)
        through = _render(hf, template, messages[: i + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise LoongError(
                f"chat template {template.name} is not prefix-consistent (rendering turn {i} changes "
                "earlier text), so its assistant tokens cannot be located; add {% generation %} blocks "
                "to it or choose data.chat_template=llama3 or qwen"
            )
        spans.append((len(before), max(len(before), len(through.rstrip()))))
    return full, spans


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token overlapping an assistant span (as transformers' own generation mask)."""
    return [int(any(s < end and start < e for s, e in spans)) for start, end in offsets]


def encode_conversation(hf: Any, template: ChatTemplate, messages: list[Message]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and its assistant mask (1 = in the loss)."""
    if not getattr(hf, "is_fast", False):
        raise LoongError("SFT needs a fast (Rust) tokenizer: the assistant mask uses token offsets")
    if template.has_generation:
        try:
            out = hf.apply_chat_template(messages, chat_template=template.source, tokenize=True,
                                         return_dict=True, return_assistant_tokens_mask=True)
        except Exception as exc:  # template errors of any kind
            raise ChatFormatError("template error", f"chat template {template.name}: {exc}") from None
        return list(out["input_ids"]), list(out["assistant_masks"])
    text, spans = assistant_spans(hf, template, messages)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), _mask_from_offsets(enc["offset_mapping"], spans)
