"""Pretraining samples from preprocessed shards through megatron-core's GPTDataset / BlendedDataset.

``data.path=PREFIX`` (a ``PREFIX.bin``/``PREFIX.idx`` pair written by ``loong-llm preprocess`` or
Megatron-LM's tools) or ``data.paths=[w1, prefix1, w2, prefix2, ...]`` (a weighted blend) is split
into train/valid documents by ``data.split`` and sampled by megatron-core into windows of
``train.seq_length + 1`` tokens, in an order shuffled from ``train.seed``. The sample order depends
on the seed, the split, the sequence length and the number of samples built
(``train.steps * train.global_batch_size``), as in Megatron-LM: a run resumed with those unchanged
sees exactly the samples the uninterrupted run saw.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loong.core.errors import LoongError
from loong.llm.data.tokenizer import Tokenizer
from loong.llm.schema import split_weights


@dataclass
class Blend:
    """Shard prefixes and their weights (None: a single prefix, sampled as it is)."""

    prefixes: list[str]
    weights: list[float] | None
    key: str  # the config key it came from, for messages


def _strip_suffix(path: str) -> str:
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def is_indexed_prefix(path: str) -> bool:
    """True when ``path`` names a shard (``path.bin``/``path.idx``, or one of them) rather than a file."""
    prefix = _strip_suffix(path)
    if Path(path).is_file() and prefix == path:
        return False
    return Path(prefix + ".bin").exists() or Path(prefix + ".idx").exists()


def parse_blend(path: str | None, paths: list | None) -> Blend:
    """``data.paths`` ``[w1, prefix1, w2, prefix2, ...]`` or a single ``data.path`` prefix → :class:`Blend`."""
    if paths is None:
        if path is None:
            raise LoongError("set data.path or data.paths to preprocessed shards")
        return Blend([_strip_suffix(str(path))], None, "data.path")
    if path is not None:
        raise LoongError("data.path and data.paths are both set; use data.paths for a blend, data.path for one corpus")
    if not paths or len(paths) % 2:
        raise LoongError(f"data.paths: expected [weight, prefix, weight, prefix, ...] pairs, got {len(paths)} "
                         f"item{'s' if len(paths) != 1 else ''}: {list(paths)}")
    weights, prefixes = [], []
    for i in range(0, len(paths), 2):
        raw, prefix = paths[i], paths[i + 1]
        try:
            weight = float(raw) if not isinstance(raw, bool) else math.nan
        except (TypeError, ValueError):
            weight = math.nan
        if math.isnan(weight):
            raise LoongError(f"data.paths[{i}]: weight {raw!r} is not a number "
                             "(expected [weight, prefix, weight, prefix, ...])")
        if not weight > 0 or math.isinf(weight):
            raise LoongError(f"data.paths[{i}]: weight must be a positive number, got {raw!r}")
        if not isinstance(prefix, str):
            raise LoongError(f"data.paths[{i + 1}]: expected a shard prefix, got {prefix!r}")
        weights.append(weight)
        prefixes.append(_strip_suffix(prefix))
    return Blend(prefixes, weights, "data.paths")


def check_files(blend: Blend) -> None:
    """Every prefix has its ``.bin`` and ``.idx``."""
    for prefix in blend.prefixes:
        missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
        if missing:
            raise LoongError(f"{blend.key}: {prefix}: missing {' and '.join(prefix + e for e in missing)} "
                             "(write shards with `loong-llm preprocess`)")


def uses_indexed_data(data: Any) -> bool:
    """True when ``data.paths`` is set or ``data.path`` names a shard prefix (else: text on the fly)."""
    return data.paths is not None or (data.path is not None and is_indexed_prefix(str(data.path)))


def indexed_blend(data: Any) -> Blend | None:
    """The checked blend when the data config names preprocessed shards, else None (text on the fly)."""
    if not uses_indexed_data(data):
        return None
    blend = parse_blend(data.path, data.paths)
    check_files(blend)
    return blend


def read_sidecar(prefix: str) -> dict | None:
    """The ``<prefix>.json`` written by ``loong-llm preprocess`` (None for shards made elsewhere)."""
    path = Path(prefix + ".json")
    return json.loads(path.read_text()) if path.is_file() else None


def check_tokenizer(blend: Blend, tokenizer: Tokenizer, model_vocab: int) -> None:
    """Shards were made with this tokenizer's vocabulary, and every token id fits the model."""
    from loong.llm.data.preprocess import vocab_fingerprint

    fingerprint = vocab_fingerprint(tokenizer)
    for prefix in blend.prefixes:
        meta = read_sidecar(prefix)
        if meta is not None:
            if (meta.get("vocab_size"), meta.get("vocab_fingerprint")) != (tokenizer.vocab_size, fingerprint):
                raise LoongError(
                    f"{blend.key}: {prefix} was preprocessed with tokenizer {meta.get('tokenizer')} "
                    f"({meta.get('vocab_size')} tokens), but this run uses {tokenizer.source} "
                    f"({tokenizer.vocab_size} tokens); set data.tokenizer to the same tokenizer or preprocess again"
                )
            top = int(meta.get("max_token_id", -1))
        else:  # shards from other tools: scan the tokens once
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            ds = IndexedDataset(prefix)
            ids = ds.bin_reader.read(ds.index.dtype, int(ds.sequence_lengths.sum()), 0)
            top = int(ids.max()) if ids.size else -1
        if top >= model_vocab:
            raise LoongError(f"{blend.key}: {prefix} holds token id {top}, but model.vocab_size is {model_vocab}")


def cache_dir(blend: Blend) -> str:
    """Where megatron caches sample indices: ``.loong-cache`` beside the first shard, else ~/.cache/loong."""
    import torch.distributed as dist

    beside = Path(blend.prefixes[0]).resolve().parent
    choice = [str(beside / ".loong-cache") if os.access(beside, os.W_OK)
              else str(Path.home() / ".cache" / "loong" / "indexed")]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)  # rank 0 writes, the others read the same folder
    return choice[0]


class _MegatronTokenizer:
    """What GPTDataset reads from a tokenizer: vocab size, EOD id and identifiers for its cache key."""

    def __init__(self, tokenizer: Tokenizer, fingerprint: str) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod_id
        self.unique_identifiers = {"class": "loong", "vocab": fingerprint, "eod": self.eod}


class IndexedSamples:
    """One split as windows of ``seq_length + 1`` token ids; ``shuffled``: index ``i`` is already random."""

    shuffled = True

    def __init__(self, dataset: Any, seq_length: int) -> None:
        self.dataset = dataset
        self.seq_length = seq_length

    def __len__(self) -> int:
        return 0 if self.dataset is None else len(self.dataset)

    def __getitem__(self, i: int) -> np.ndarray:
        sample = self.dataset[int(i)]  # tokens = window[:-1], labels = window[1:]
        return np.concatenate([sample["tokens"].numpy(), sample["labels"][-1:].numpy()])


def _split_matrix(split: str) -> list:
    parts = [p.strip() for p in str(split).split(",")]
    split_weights(split)  # checked by the schema too; this is also called with splits built in code
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    return convert_split_vector_to_split_matrix(parse_and_normalize_split(",".join(parts)))


def build_datasets(blend: Blend, tokenizer: Tokenizer, seq_length: int, seed: int, split: str,
                   train_samples: int, valid_samples: int, cache: str | None = None
                   ) -> tuple[IndexedSamples, IndexedSamples]:
    """Train and valid samples through ``BlendedMegatronDatasetBuilder`` (collective when distributed).

    Rank 0 builds the index caches first, the other ranks load them (megatron's protocol). The test
    split is not built; the valid split is empty when some shard has no validation documents.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from loong.llm.data.preprocess import vocab_fingerprint

    matrix = _split_matrix(split)
    valid_ok = matrix[1] is not None
    for prefix in blend.prefixes:
        lengths = IndexedDataset(prefix).sequence_lengths
        n = len(lengths)
        span = [(int(round(m[0] * n)), int(round(m[1] * n))) if m else (0, 0) for m in matrix[:2]]
        if span[0][1] <= span[0][0]:  # megatron repeats a small split as often as needed, but not an empty one
            raise LoongError(f"{blend.key}: {prefix} has {n} document{'s' if n != 1 else ''}; "
                             f"data.split={split} leaves none for training")
        valid_ok = valid_ok and span[1][1] > span[1][0]
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(blend.prefixes, blend.weights), split=split,
        tokenizer=_MegatronTokenizer(tokenizer, vocab_fingerprint(tokenizer)), path_to_cache=cache,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
    )
    config.split_matrix = [matrix[0], matrix[1] if valid_ok else None, None]  # no test split
    sizes = [train_samples, valid_samples if valid_ok else 0, 0]
    # Every rank feeds its own micro-batches (no broadcast over tensor parallelism), so every rank
    # builds; megatron builds on rank 0 first and the others then read its cache.
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return IndexedSamples(train, seq_length), IndexedSamples(valid, seq_length)


def build_pretrain_datasets(cfg: Any, tokenizer: Tokenizer) -> tuple[IndexedSamples, IndexedSamples]:
    """The pretrain task's train/valid samples from ``cfg.data`` (call inside the run's process groups)."""
    blend = indexed_blend(cfg.data)
    if blend is None:
        raise LoongError("data.path / data.paths do not name preprocessed shards")
    check_tokenizer(blend, tokenizer, cfg.model.vocab_size)
    t = cfg.train
    return build_datasets(blend, tokenizer, t.seq_length, t.seed, cfg.data.split,
                          train_samples=t.steps * t.global_batch_size,
                          valid_samples=max(t.eval_iters, 1) * t.global_batch_size, cache=cache_dir(blend))
