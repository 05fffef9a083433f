"""Tokenizers for Pi0.5's prompt: a local folder (a PaliGemma tokenizer for real checkpoints) or the built-in tiny one.

The tiny tokenizer is a word-level vocabulary built in-process (no files, no downloads): Gemma's special tokens at
Gemma's ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3), the prompt's fixed words and punctuation, the 256
state bins, and the words of the synthetic reach task's instructions. Like PaliGemma's it prepends ``<bos>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from loong.core.errors import LoongError
from loong.embodied.policies.pi05.config import PALIGEMMA_TOKENIZER, TINY_TOKENIZER
from loong.embodied.policies.word_tokenizer import reach_vocabulary, word_level_backend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
PROMPT_WORDS = ("Task", "State", "Action", ":", ",", ";", "-", ".")


def tiny_vocabulary() -> list[str]:
    """The tiny tokenizer's tokens, in id order."""
    return reach_vocabulary([*SPECIAL_TOKENS, *PROMPT_WORDS, *(str(i) for i in range(256))])


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """The built-in word-level tokenizer (see the module docstring)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    words = tiny_vocabulary()
    backend = word_level_backend(words)
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                           special_tokens=[("<bos>", words.index("<bos>"))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def load_tokenizer(name: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer ``name`` names: ``"builtin:tiny"`` or a local tokenizer folder (never the Hub)."""
    if name == TINY_TOKENIZER:
        return tiny_tokenizer()
    if not name:
        raise LoongError(f"pi05.tokenizer: not set; give a local folder holding a PaliGemma tokenizer (e.g. a "
                         f"download of {PALIGEMMA_TOKENIZER}) or {TINY_TOKENIZER!r}")
    path = Path(name).expanduser()
    if not path.is_dir():
        raise LoongError(f"pi05.tokenizer: {name!r} is not a folder; give a local tokenizer folder (e.g. a download "
                         f"of {PALIGEMMA_TOKENIZER}) or {TINY_TOKENIZER!r}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise LoongError(f"pi05.tokenizer: {path} holds no tokenizer transformers can load ({exc})") from exc


__all__ = ["load_tokenizer", "tiny_tokenizer", "tiny_vocabulary"]
