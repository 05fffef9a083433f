"""``embodied.vla``: a VLA policy (Pi0.5, GR00T N1.7 / N1.6) trained by flow matching on the fsdp engine.

The trained module is the policy itself (``SPEC.policy_class(config)``; its ``forward`` is its loss, so the engine's
wrappers see it); its :meth:`~loong.embodied.policies.base.VLAPolicy.blocks` are what FSDP2 shards and recomputation
wraps. The policy's processor runs on the host, in the DataLoader's workers, as the collate function: raw frames
in, the model's tensors out.

Determinism: sample ``g`` of the run (global batch ``s`` holds ``g = s·B .. s·B + B − 1``) is the frame the data
stream puts there (:class:`~loong.embodied.data.sampler.MixtureStream`, a function of ``train.seed``), and the
flow-matching draws of a micro-batch (noise, time) come from the global generator seeded with (``train.seed``,
step, the micro-batch's index in the global batch). So the stream is a function of (``train.seed``, step): a
resumed run continues exactly, and a DP=2 run equals one rank accumulating two micro-batches.

At start the logging rank writes ``<run_dir>/policy/`` (``policy.json``: the policy name and its resolved config;
the processor's files: statistics, tokenizer), which evaluation, serving and export read with the checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loong.core.config.schema import to_dict
from loong.core.engines.fsdp.task import FSDPTask
from loong.core.errors import LoongError
from loong.core.registry import TASKS
from loong.embodied.policies.base import PolicyConfig, PolicyProcessor, PolicySpec, VLAPolicy

#: the stream offset of evaluation batches: far from any training step, so they get fresh draws
EVAL_OFFSET = 10**8
#: the batch key carrying a micro-batch's seed of the flow-matching draws (a Python int; never moved to a device)
SEED_KEY = "_draw_seed"
#: the folder under the run directory that holds what inference needs besides the weights
POLICY_DIR = "policy"
POLICY_JSON = "policy.json"


def draw_seed(seed: int, step: int, index: int) -> int:
    """The seed of the flow-matching draws of micro-batch ``index`` (its place in the global batch) of ``step``."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def write_policy_dir(directory: Path, spec: PolicySpec, config: PolicyConfig, processor: PolicyProcessor) -> Path:
    """``directory`` with ``policy.json`` (``{"policy": name, "config": fields}``) and the processor's files."""
    directory.mkdir(parents=True, exist_ok=True)
    processor.save(directory)
    record = {"policy": spec.name, "config": to_dict(config)}
    (directory / POLICY_JSON).write_text(json.dumps(record, indent=2) + "\n")
    return directory


def check_lerobot_export(spec: PolicySpec, config: PolicyConfig) -> None:
    """``train.save_lerobot``: refuse, before training, a policy or config that lerobot cannot hold (e.g. the tiny
    Pi0.5, whose sizes are no lerobot Gemma variant): the mapping's ``to_lerobot`` of the model's shapes, on the
    meta device (nothing allocated)."""
    if spec.lerobot is None:
        raise LoongError(f"train.save_lerobot=true: lerobot has no {spec.name} policy to export to; drop "
                         "train.save_lerobot (the Loong checkpoint is the trained policy)")
    import importlib

    mapping = importlib.import_module(spec.lerobot)
    with torch.device("meta"):
        state = spec.policy_class(config).state_dict()
        try:
            mapping.to_lerobot(config, state)
        except LoongError as exc:
            raise LoongError(f"train.save_lerobot=true: {exc}") from None


def load_initial_weights(model: nn.Module, path: Path, spec: PolicySpec, config: PolicyConfig) -> None:
    """``model.init_from``: the weights of a Loong checkpoint (run, ``checkpoints`` or step folder) or of a lerobot
    policy folder (``config.json`` + ``model.safetensors``) into ``model``, whose policy and config they must
    match."""
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        from loong.embodied.lerobot_io import import_lerobot

        name, theirs, state, _stats = import_lerobot(path)
        if name != spec.name:
            raise LoongError(f"model.init_from={path}: a lerobot {name} policy, not model.policy={spec.name}")
        ours_fields, their_fields = to_dict(config), to_dict(theirs)
        # sizes must agree; data-side fields (chunking, inference steps, tokenizer) are this run's to choose
        differ = sorted(k for k in ours_fields if ours_fields[k] != their_fields.get(k))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise LoongError(f"model.init_from={path}: its weights do not fit model.policy={spec.name} with this "
                             f"preset and model.config (fields that differ: {', '.join(differ) or 'none'}; "
                             f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
        return
    import torch.distributed.checkpoint as dcp

    from loong.core.checkpoint import read_config, resolve_checkpoint
    from loong.core.engines.fsdp.checkpoint import check_same_model

    step_dir = resolve_checkpoint(path)
    saved = read_config(step_dir).get("model", {})
    if saved.get("policy") != spec.name:
        raise LoongError(f"model.init_from={path}: {step_dir} holds a {saved.get('policy')!r} policy, not "
                         f"model.policy={spec.name}")
    state = {"model": model.state_dict()}
    try:
        check_same_model(step_dir, state["model"], allow_missing=False)
    except LoongError as exc:
        raise LoongError(f"model.init_from={path}: does not fit this model.preset / model.config ({exc})") from None
    dcp.load(state, checkpoint_id=str(step_dir))  # in place, into the model's own tensors


@TASKS.register("embodied.vla")
class VLATask(FSDPTask):
    """Flow-matching training of ``model`` (a :class:`~loong.embodied.schema.PolicyModelConfig`) on ``data``."""

    #: the inputs reach the policy as the processor made them: the target actions (and the draws made from their
    #: dtype) stay fp32 under bf16 training, as lerobot computes the loss; each policy casts what enters its weights
    cast_root_inputs = False

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        spec = cfg.model.spec()
        for i, root in enumerate(cfg.data.roots() or []):
            where = "data.repo_root" if isinstance(cfg.data.repo_root, str) else f"data.repo_root[{i}]"
            if not Path(root).is_dir():
                raise LoongError(f"{where}={root}: no such folder (a local LeRobotDataset v3 folder is expected)")
        if cfg.train.save_lerobot:
            check_lerobot_export(spec, cfg.model.policy_config())
        if cfg.parallel.cp_ulysses * cfg.parallel.cp_ring > 1:
            raise LoongError("parallel.cp_ulysses / parallel.cp_ring: a VLA policy's sequences are short; train it "
                             "data-parallel (parallel.fsdp=full|hybrid|none) without context parallelism")

    # --- data --------------------------------------------------------------------------------
    def setup_data(self) -> None:
        from loong.embodied.data.mix import build_mixture

        c, d = self.cfg, self.cfg.data
        self.spec = c.model.spec()
        self.policy_config = c.model.policy_config()
        self.gbs, self.mbs = c.train.global_batch_size, c.train.micro_batch_size
        roots = self._roots()
        if len(roots) > 1:
            # a mix normalises each source with its own statistics (build_mixture's norm_map), but the processors
            # take one dataset's; until they accept the mixture's, a run reads one dataset (docs/embodied.md)
            raise LoongError(f"data.repo_root: {len(roots)} datasets; training on a mix is not wired to the policies' "
                             "processors yet: train on one dataset")
        # values stay raw in the mixture: the policy's processor normalises them with the dataset's statistics
        self.mixture = build_mixture([str(r) for r in roots], d.weights, chunk_size=self.policy_config.chunk_size,
                                     cameras=d.cameras, norm_map=None, on_error=d.on_error,
                                     video_backend=d.video_backend)
        self.dataset = self.mixture.sources[0]
        self.processor = self.spec.processor_class.from_dataset(self.policy_config, self.dataset)
        self.device = self.accelerator.device(self.layout.local_rank)
        self._train_loader: Any = None
        self._train_iter: Iterator[dict] | None = None
        self._train_next: tuple[int, int] | None = None
        self._data_wait_s = 0.0
        if self.layout.is_logging_rank:
            ds = self.dataset
            print(f"embodied data: {ds.root}: {ds.num_episodes} episodes, {len(ds)} frames, cameras "
                  f"{', '.join(ds.camera_keys)}, state {ds.state_dim}, action {ds.action_dim}, {len(ds.tasks)} "
                  "task(s)", file=sys.stderr)

    def _roots(self) -> list[Path]:
        """The datasets' folders; the synthetic reach dataset is written on first use (by the first rank, the
        others wait and read it)."""
        d = self.cfg.data
        roots = d.roots()
        if roots is not None:
            return [Path(r) for r in roots]
        from loong.embodied.data.synthetic import ensure_reach_dataset

        def ensure(progress: bool) -> Path:
            return ensure_reach_dataset(Path(self.cfg.output_dir) / ".cache", num_episodes=d.synthetic_episodes,
                                        seed=d.synthetic_seed, use_videos=d.synthetic_videos, progress=progress)

        first = not dist.is_initialized() or dist.get_rank() == 0
        root = ensure(self.cfg.train.progress) if first else None
        if dist.is_initialized():
            dist.barrier()
        return [root if root is not None else ensure(False)]

    def _loader(self, seed: int, first_step: int, workers: int) -> Any:
        """This rank's micro-batches from global batch ``first_step`` on (endless): micro-batch ``m`` of a step is
        the ``m``-th ``dp × micro_batch_size`` slice of its global batch, of which this rank reads its
        ``micro_batch_size`` (:class:`~loong.embodied.data.sampler.RankBatches`), decoded and processed in
        ``workers`` DataLoader workers and prefetched to the device."""
        from loong.embodied.data.loader import make_train_loader

        cuda = self.device.type == "cuda"
        return make_train_loader(self.mixture, batch_size=self.mbs, collate=self.processor, seed=seed,
                                 start_sample=first_step * self.gbs, rank=self.layout.dp_rank, world=self.layout.dp,
                                 num_workers=workers, pin_memory=cuda, device=self.device if cuda else None,
                                 prefetch_factor=2 if workers else None)

    def _seeded(self, batch: dict, step: int, m: int) -> dict:
        # micro-batch m of this rank is slice m·dp + dp_rank of the global batch: its draws follow the samples
        return {**batch, SEED_KEY: draw_seed(self.cfg.train.seed, step, m * self.layout.dp + self.layout.dp_rank)}

    def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict]:
        if self._train_iter is None or self._train_next != (step, num_microbatches):  # first, resumed or skipped
            self._train_loader = self._loader(self.cfg.train.seed, step, self.cfg.data.num_workers)
            self._train_iter = iter(self._train_loader)
        self._train_next = (step + 1, num_microbatches)
        # the host's wait for the loader (decoding and processing run ahead in its workers): the step's data wait
        waited = time.perf_counter()
        batches = [self._seeded(next(self._train_iter), step, m) for m in range(num_microbatches)]
        self._data_wait_s = time.perf_counter() - waited
        return iter(batches)

    def eval_microbatches(self, index: int, num_microbatches: int) -> Iterator[dict]:
        # a stream of its own (seed + 1) and draws of their own (EVAL_OFFSET): the same batches at every evaluation
        batches = iter(self._loader(self.cfg.train.seed + 1, index, 0))
        return iter([self._seeded(next(batches), EVAL_OFFSET + index, m) for m in range(num_microbatches)])

    def after_train_step(self, step: int, extra: dict[str, float]) -> dict[str, float]:
        skipped = getattr(self._train_loader, "num_skipped", 0)
        out = {"data_wait_s": self._data_wait_s}
        return {**out, "skipped_samples": float(skipped)} if skipped else out

    # --- model and loss ----------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        policy = self.spec.policy_class(self.policy_config)
        if self.layout.is_logging_rank and self.run_dir is not None:
            write_policy_dir(self.run_dir / POLICY_DIR, self.spec, self.policy_config, self.processor)
        return policy

    def init_weights(self, model: nn.Module) -> None:
        path = self.cfg.model.init_from
        if path is None:
            return
        load_initial_weights(model, Path(path), self.spec, self.policy_config)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        assert isinstance(model, VLAPolicy)
        return list(model.blocks())

    def mlp(self, block: nn.Module) -> nn.Module | None:
        """What ``model.recompute=selective`` recomputes in a block: its largest feed-forward module at any depth
        (a Pi0.5 ``JointLayer`` holds the VLM's and the expert's MLP, one level down: the VLM's, 4x the wider)."""
        from loong.core.engines.fsdp.task import MLP_NAMES

        found = [m for name, m in block.named_modules() if name.rsplit(".", 1)[-1] in MLP_NAMES]
        return max(found, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        inputs = dict(batch)
        torch.manual_seed(inputs.pop(SEED_KEY))  # this micro-batch's noise and time, whatever the layout
        loss, metrics = model(inputs)
        return loss, metrics

    def save_artifacts(self, checkpoint_dir: Path) -> None:
        """The policy folder beside each checkpoint too, so that a step folder copied alone still serves."""
        write_policy_dir(checkpoint_dir / POLICY_DIR, self.spec, self.policy_config, self.processor)

    def export(self, model: nn.Module, out_dir: Path) -> Path | None:
        """``train.save_lerobot``: the trained policy as a lerobot policy folder ``<run>/lerobot/`` (collective:
        every rank gathers, the logging rank writes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.layout.is_logging_rank:
            return None
        from loong.embodied.lerobot_io import export_lerobot

        return export_lerobot(self.spec.name, self.policy_config, dict(state), self.processor,
                              out_dir.parent / "lerobot")

    # --- accounting --------------------------------------------------------------------------
    def tokens_per_step(self) -> int:
        """Samples (frames with their action chunks) per global batch: the progress bar's "tok/s" counts samples."""
        return self.gbs


__all__ = ["EVAL_OFFSET", "POLICY_DIR", "POLICY_JSON", "SEED_KEY", "VLATask", "check_lerobot_export", "draw_seed", "load_initial_weights",
           "write_policy_dir"]
