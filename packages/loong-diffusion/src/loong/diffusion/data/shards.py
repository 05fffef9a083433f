"""Training clips from a ``loong-diffusion preprocess`` folder (``data.source=shards``, ``data.path=OUT``).

:class:`LatentShards` reads clip ``i``: its normalised VAE latents ``[c, f, h, w]`` and its caption's text
embeddings zero-padded to ``text_len`` (as ``WanPipeline`` pads them), plus its bucket; and where the folder was
preprocessed with ``--condition`` / ``--image-encoder``, its image-to-video condition latent and CLIP features.

:class:`BucketOrder` decides which clip stream sample ``n`` is, so that every global batch is one bucket (its
micro-batches stack into one shape on every DP rank): an epoch shuffles each bucket's clips (seeded by
``(seed, epoch, bucket)``), cuts them into groups of ``batch`` clips (a bucket's last group is filled up from the
start of its shuffled list, so no clip is left out and small buckets still train), and shuffles the groups of all
buckets (seeded by ``(seed, epoch)``). Sample ``n`` is then clip ``k`` of group ``g`` of epoch ``e``: a pure
function of ``(seed, n)``, so a resumed run and every parallel layout read the same clips.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loong.core.errors import LoongError

FORMAT, VERSION = "loong-diffusion-shards", 1
#: open shard files kept per process (safetensors maps them lazily; a few suffice for a bucket's group)
OPEN_SHARDS = 8


def read_index(path: str | Path, key: str = "data.path") -> dict[str, Any]:
    """The ``index.json`` of a finished preprocess folder, or a :class:`LoongError` naming ``key``."""
    folder = Path(path)
    index = folder / "index.json"
    if not folder.is_dir():
        raise LoongError(f"{key}: {folder} {'is not a folder' if folder.exists() else 'does not exist'} "
                         "(expected the output folder of loong-diffusion preprocess)")
    if not index.is_file():
        raise LoongError(f"{key}: {folder} has no index.json (expected the output folder of loong-diffusion "
                         "preprocess)")
    try:
        meta = json.loads(index.read_text())
    except json.JSONDecodeError as exc:
        raise LoongError(f"{key}: {index} is not valid JSON ({exc.msg})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise LoongError(f"{key}: {index} is not a {FORMAT} v{VERSION} index (format {meta.get('format')!r}, "
                         f"version {meta.get('version')!r})")
    if not meta.get("complete"):
        raise LoongError(f"{key}: {folder} is an unfinished preprocess ({meta.get('lines', 0)} manifest lines "
                         "done); rerun the same loong-diffusion preprocess command to finish it")
    return meta


@dataclass(frozen=True)
class ClipRecord:
    """Where clip ``i`` lives: ``shard`` file, its key ``slot``, and its bucket and shapes."""

    shard: str
    slot: int
    bucket: str
    latent_shape: tuple[int, int, int, int]
    text_tokens: int
    caption: str


class LatentShards:
    """The clips of a preprocess folder, in manifest order; ``clip(i)`` reads one."""

    def __init__(self, path: str | Path, text_len: int, key: str = "data.path") -> None:
        self.folder = Path(path)
        self.meta = read_index(path, key)
        self.text_len = text_len
        self.latent_channels: int = int(self.meta["latent_channels"])
        self.text_dim: int = int(self.meta["text_dim"])
        #: what conditions an image-to-video model: none | first | first_last (folders before the option: none)
        self.condition: str = self.meta.get("condition", "none")
        #: the CLIP features' ``{images, tokens, dim}``, or None when the folder has none
        self.image: dict[str, int] | None = self.meta.get("image")
        self.records: list[ClipRecord] = []
        for number in range(int(self.meta["shards"])):
            sidecar = self.folder / f"shard-{number:05d}.json"
            if not sidecar.is_file():
                raise LoongError(f"{key}: {sidecar} is missing (index.json lists {self.meta['shards']} shards)")
            side = json.loads(sidecar.read_text())
            for slot, s in enumerate(side["samples"]):
                self.records.append(ClipRecord(side["shard"], slot, s["bucket"], tuple(s["latent_shape"]),
                                               int(s["text_tokens"]), s["caption"]))
        if not self.records:
            raise LoongError(f"{key}: {self.folder} holds no clips")
        #: bucket names in first-seen order, and each clip's bucket number
        self.buckets: list[str] = list(dict.fromkeys(r.bucket for r in self.records))
        number = {name: i for i, name in enumerate(self.buckets)}
        self.bucket_of: list[int] = [number[r.bucket] for r in self.records]
        self.latent_shapes: dict[str, tuple[int, int, int, int]] = {r.bucket: r.latent_shape for r in self.records}
        self._open: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self.records)

    @property
    def max_text_tokens(self) -> int:
        return max(r.text_tokens for r in self.records)

    def _handle(self, shard: str) -> Any:
        from safetensors import safe_open

        if shard not in self._open:
            if len(self._open) >= OPEN_SHARDS:
                self._open.popitem(last=False)
            self._open[shard] = safe_open(str(self.folder / shard), framework="pt")
        self._open.move_to_end(shard)
        return self._open[shard]

    def clip(self, i: int) -> dict[str, Any]:
        """Clip ``i``: ``latents [c, f, h, w]``, ``text [text_len, text_dim]`` (zero-padded; a caption longer
        than ``text_len`` is cut, as the tokenizer would have cut it), ``bucket`` (its name); where the folder holds
        them, ``condition [c, f, h, w]`` (the condition latent) and ``image [images · tokens, dim]``."""
        r = self.records[i]
        handle = self._handle(r.shard)
        latents = handle.get_tensor(f"{r.slot}.latents").float()
        tokens = handle.get_tensor(f"{r.slot}.text").float()[: self.text_len]
        text = torch.zeros(self.text_len, tokens.shape[1], dtype=torch.float32)
        text[: tokens.shape[0]] = tokens
        clip = {"latents": latents, "text": text, "bucket": r.bucket}
        if self.condition != "none":
            clip["condition"] = handle.get_tensor(f"{r.slot}.condition").float()
        if self.image is not None:
            clip["image"] = handle.get_tensor(f"{r.slot}.image").float()
        return clip


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for part in parts:
        seed = (seed * 1_000_000_007 + part) % (2**63 - 1)  # a stable mix (Python's hash() is not)
    return torch.Generator().manual_seed(seed)


class BucketOrder:
    """Stream sample ``n`` → clip index, with every aligned run of ``batch`` samples from one bucket (module
    docstring). ``bucket_of[i]``: clip ``i``'s bucket number."""

    def __init__(self, bucket_of: Sequence[int], batch: int, seed: int) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.batch, self.seed = batch, seed
        members: dict[int, list[int]] = {}
        for clip, bucket in enumerate(bucket_of):
            members.setdefault(bucket, []).append(clip)
        self.members = [torch.tensor(members[b]) for b in sorted(members)]
        self.groups_per_epoch = sum(math.ceil(len(m) / batch) for m in self.members)
        self._epoch: tuple[int, list[torch.Tensor]] | None = None  # the last epoch's groups (a cache)

    @property
    def epoch_length(self) -> int:
        """Samples per epoch (every clip at least once)."""
        return self.groups_per_epoch * self.batch

    def _groups(self, epoch: int) -> list[torch.Tensor]:
        if self._epoch is None or self._epoch[0] != epoch:
            groups = []
            for b, clips in enumerate(self.members):
                perm = clips[torch.randperm(len(clips), generator=_generator(self.seed, epoch, b, 1))]
                n = math.ceil(len(clips) / self.batch) * self.batch
                filled = perm[torch.arange(n) % len(clips)]
                groups.extend(filled.view(-1, self.batch))
            shuffle = torch.randperm(len(groups), generator=_generator(self.seed, epoch, 2))
            self._epoch = (epoch, [groups[int(i)] for i in shuffle])
        return self._epoch[1]

    def __call__(self, n: int) -> int:
        epoch, within = divmod(n, self.epoch_length)
        group, k = divmod(within, self.batch)
        return int(self._groups(epoch)[group][k])


def check_shards(shards: LatentShards, *, channels: int, text_dim: int, patch_size: Sequence[int], text_len: int,
                 cp: int, preset: str) -> None:
    """Config-time checks of a shard folder against the model: latent channels, text width, every bucket's latent
    shape against the patch size and its token count against the context-parallel size, caption lengths."""
    where = f"data.path={shards.folder}"
    if shards.latent_channels != channels:
        raise LoongError(f"{where} holds {shards.latent_channels}-channel latents, but model.preset={preset} "
                         f"denoises {channels} channels (model.out_channels; Wan 2.1's VAE gives 16, Wan 2.2's "
                         "48): preprocess with the model's VAE, or pick a matching preset")
    if shards.text_dim != text_dim:
        raise LoongError(f"{where} holds text embeddings of width {shards.text_dim}, but model.preset={preset} "
                         f"takes model.text_dim={text_dim}: preprocess with the model's text encoder (UMT5-XXL: "
                         "4096), or set model.text_dim")
    for bucket, (_, f, h, w) in shards.latent_shapes.items():
        if f % patch_size[0] or h % patch_size[1] or w % patch_size[2]:
            raise LoongError(f"{where}: bucket {bucket} has latents of {f}x{h}x{w}, which do not divide by "
                             f"model.patch_size={list(patch_size)}; preprocess with --buckets whose height and "
                             "width are multiples of the VAE's factor times the patch size")
        tokens = (f // patch_size[0]) * (h // patch_size[1]) * (w // patch_size[2])
        if tokens % cp:
            raise LoongError(f"{where}: bucket {bucket} has {tokens} video tokens, which do not divide by the "
                             f"context-parallel size {cp} (parallel.cp_ulysses × parallel.cp_ring)")
    if shards.max_text_tokens > text_len:
        raise LoongError(f"data.text_len={text_len} is shorter than the longest caption in {shards.folder} "
                         f"({shards.max_text_tokens} tokens); set data.text_len>={shards.max_text_tokens} "
                         "(Wan: 512, the length its pipeline pads to)")


__all__ = ["BucketOrder", "ClipRecord", "LatentShards", "check_shards", "read_index"]
