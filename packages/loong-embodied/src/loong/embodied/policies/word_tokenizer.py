"""The word-level tokenizers the tiny presets build in-process (no files, no downloads): a fixed list of tokens
followed by the words of the synthetic reach task's instructions, split on whitespace and punctuation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def reach_vocabulary(fixed: Sequence[str], instruction: Callable[[str], str] = lambda text: text) -> list[str]:
    """``fixed`` in order, then each word of every reach instruction (after ``instruction``) not yet in the list."""
    from loong.embodied.envs.reach import COLOURS, instruction_for

    words = list(fixed)
    for colour in COLOURS:
        for word in instruction(instruction_for(colour)).split():
            if word not in words:
                words.append(word)
    return words


def word_level_backend(words: Sequence[str], unk_token: str = "<unk>") -> Tokenizer:
    """A ``tokenizers`` WordLevel tokenizer over ``words`` (id = position), whitespace pre-tokenised."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token=unk_token))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend


__all__ = ["reach_vocabulary", "word_level_backend"]
