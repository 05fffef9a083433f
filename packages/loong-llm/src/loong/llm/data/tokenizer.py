"""Tokenizers: a local Hugging Face tokenizer folder, or the tiny BPE built from the shipped corpus."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from loong.core.errors import LoongError

PACKAGED_VOCAB_SIZE = 512
EOD_TOKEN = "<|endoftext|>"


class Tokenizer:
    """The small interface training needs: ``encode``, ``eod_id``, ``vocab_size``, ``save``."""

    def __init__(self, hf_tokenizer, source: str) -> None:  # noqa: ANN001
        self.hf = hf_tokenizer
        self.source = source
        eod = hf_tokenizer.eos_token_id
        if eod is None:
            raise LoongError(f"tokenizer {source} has no end-of-sequence token (eos_token)")
        self.eod_id: int = int(eod)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts at once (fast tokenizers parallelise this)."""
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer files (loadable by ``AutoTokenizer.from_pretrained``)."""
        self.hf.save_pretrained(str(directory))


def packaged_corpus_path() -> Path:
    """The corpus shipped with loong-llm (CPython docstrings, PSF licence)."""
    return Path(str(resources.files("loong.llm") / "assets" / "corpus.jsonl"))


def build_packaged_tokenizer() -> Tokenizer:
    """Train the tiny byte-level BPE on the shipped corpus (deterministic, ~1 s, no downloads)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in packaged_corpus_path().read_text().splitlines()]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=PACKAGED_VOCAB_SIZE,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOD_TOKEN, bos_token=EOD_TOKEN)
    return Tokenizer(hf, "packaged")


def load_tokenizer(path: str | None) -> Tokenizer:
    """``path`` (a local HF tokenizer folder) or, when None, the packaged tokenizer."""
    if path is None:
        return build_packaged_tokenizer()
    folder = Path(path)
    if not folder.exists():
        raise LoongError(f"data.tokenizer: {path} does not exist")
    from transformers import AutoTokenizer

    from loong.llm.hf_io import TOKENIZER_FILES

    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise LoongError(f"data.tokenizer: cannot load a tokenizer from {path}: no tokenizer files (expected e.g. "
                         "tokenizer.json or tokenizer.model)")
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types for unreadable folders
        reason = " ".join(str(exc).split())[:300]  # one line: some of its messages span several
        raise LoongError(f"data.tokenizer: cannot load a tokenizer from {path}: {reason}") from None
    return Tokenizer(hf, str(folder))
