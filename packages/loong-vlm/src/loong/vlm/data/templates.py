"""Chat templates of the vision-language families, with image and video content parts.

``data.chat_template`` chooses one:

- ``auto``: the processor folder's own template when it has one, else the family's packaged template;
- ``processor``: the processor's own template (an error when it has none);
- ``qwen2_vl`` (Qwen2-VL / Qwen2.5-VL), ``qwen3_vl``, ``internvl``: the packaged templates below;
- a path to a ``.jinja`` file.

The loss covers the assistant turns' content and end-of-turn marker (loong-llm's
:func:`~loong.llm.sft.templates.assistant_spans`, which needs a prefix-consistent template).
"""

from __future__ import annotations

from pathlib import Path

from loong.core.errors import LoongError, did_you_mean
from loong.llm.sft.templates import ChatTemplate


def _chatml(image: str, video: str) -> str:
    """ChatML (``<|im_start|>role\\n...<|im_end|>\\n``) rendering image and video parts as ``image`` / ``video``."""
    parts = (
        "{%- macro render(content) -%}"
        "{%- if content is string -%}{{- content -}}"
        "{%- else -%}{%- for part in content -%}"
        f"{{%- if part['type'] == 'image' -%}}{{{{- '{image}' -}}}}"
        f"{{%- elif part['type'] == 'video' -%}}{{{{- '{video}' -}}}}"
        "{%- else -%}{{- part['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}"
    )
    return parts + (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['role'] == 'assistant' -%}"
        "{%- generation -%}{{- render(message['content']) + '<|im_end|>' -}}{%- endgeneration -%}"
        "{%- else -%}{{- render(message['content']) + '<|im_end|>' -}}{%- endif -%}"
        "{{- '\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


QWEN2_VL_TEMPLATE = _chatml("<|vision_start|><|image_pad|><|vision_end|>",
                            "<|vision_start|><|video_pad|><|vision_end|>")
"""Qwen2-VL / Qwen2.5-VL: an image is ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor repeats
the pad once per merged patch), a video likewise with ``<|video_pad|>``; no default system prompt."""

QWEN3_VL_TEMPLATE = _chatml("<|vision_start|><|image_pad|><|vision_end|>", "<|video_pad|>")
"""Qwen3-VL: images as Qwen2.5-VL; a video is a bare ``<|video_pad|>``, which the processor expands into
``<t seconds><|vision_start|>frame pads<|vision_end|>`` per temporal patch (the timestamps are text), so each
frame group is wrapped once, as the original Qwen3-VL prompt has it."""

INTERNVL_TEMPLATE = _chatml("<IMG_CONTEXT>\\n", "<video>\\n")
"""InternVL 3.5: ChatML; an image is ``<IMG_CONTEXT>`` (expanded to ``<img>`` + context tokens per tile +
``</img>``), a video ``<video>`` (``FrameN: <img>...</img>`` per frame), each followed by a newline."""

PACKAGED = {"qwen2_vl": QWEN2_VL_TEMPLATE, "qwen3_vl": QWEN3_VL_TEMPLATE, "internvl": INTERNVL_TEMPLATE}
#: processor family -> its packaged template
FAMILY_TEMPLATE = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl", "internvl": "internvl"}


def own_template(hf_processor) -> str | None:  # noqa: ANN001
    """The processor's own chat template (its default one when it has several), or None."""
    own = getattr(hf_processor, "chat_template", None)
    if own is None:
        own = getattr(getattr(hf_processor, "tokenizer", None), "chat_template", None)
    if isinstance(own, dict):
        own = own.get("default")
    return own if isinstance(own, str) and own.strip() else None


def check_template_name(name: str) -> None:
    """Cheap validation of ``data.chat_template`` before anything is loaded."""
    if name in ("auto", "processor", *PACKAGED):
        return
    if name.endswith(".jinja"):
        if not Path(name).is_file():
            raise LoongError(f"data.chat_template: {name} does not exist")
        return
    raise LoongError(
        f"data.chat_template: unknown template {name!r}{did_you_mean(name, ['auto', 'processor', *PACKAGED])} "
        f"(choose auto, processor, {', '.join(PACKAGED)}, or a .jinja file)"
    )


def resolve_vision_template(name: str, hf_processor, family: str) -> ChatTemplate:  # noqa: ANN001
    """The template ``data.chat_template=name`` selects for a processor of ``family``."""
    check_template_name(name)
    own = own_template(hf_processor)
    if name == "auto":
        if own:
            return ChatTemplate("processor", own)
        name = FAMILY_TEMPLATE[family]
    if name == "processor":
        if own is None:
            raise LoongError("data.chat_template=processor: the processor has no chat template; choose "
                             f"{FAMILY_TEMPLATE[family]}")
        return ChatTemplate("processor", own)
    if name in PACKAGED:
        return ChatTemplate(name, PACKAGED[name])
    return ChatTemplate(name, Path(name).read_text(encoding="utf-8"))
