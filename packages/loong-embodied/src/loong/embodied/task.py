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
        extra = getattr(mapping, "export_options", None)
        try:
            mapping.to_lerobot(config, state, **(extra(config, state, None) if extra else {}))
        except LoongError as exc:
            raise LoongError(f"train.save_lerobot=true: {exc}") from None


def lerobot_export_dataset(cfg: Any) -> int | None:
    """``train.save_lerobot_dataset``: the index of the dataset of ``data.repo_root`` it names (None: unset, the
    export's default, the first), resolved as ``convert --dataset-index`` resolves
    (:func:`~loong.embodied.inference.resolve_dataset`) against the records a mix's processor saves (each dataset's
    folder, resolved, and its name: ``data.normalize.source_record``); a LoongError naming the key, the value and
    the datasets when it names none."""
    value = cfg.train.save_lerobot_dataset
    if value is None:
        return None
    from loong.core.config.checks import show
    from loong.embodied.inference import resolve_dataset

    roots = [Path(r).expanduser().resolve() for r in cfg.data.roots() or []]
    records = [{"root": str(root), "name": root.name} for root in roots]
    return resolve_dataset(records, value, f"train.save_lerobot_dataset={show(value)}",
                           of="data.repo_root's" if roots else "the run's")


def is_lerobot_folder(path: Path) -> bool:
    """Whether ``path`` is a lerobot policy folder (``config.json`` + ``model.safetensors``)."""
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _lerobot_initial_state(path: Path, spec: PolicySpec, config: PolicyConfig,
                           expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights of the lerobot policy folder ``path`` in Loong's names, refused unless they are a
    ``spec.name`` policy's with exactly the names and shapes of ``expected`` (the model's state dict)."""
    from loong.embodied.lerobot_io import import_lerobot

    where = f"model.init_from={path}"
    try:
        name, theirs, state, _stats = import_lerobot(path)
    except LoongError as exc:
        raise LoongError(f"{where}: {exc}") from None
    if name != spec.name:
        raise LoongError(f"{where}: a lerobot {name} policy, not model.policy={spec.name}")
    ours_fields, their_fields = to_dict(config), to_dict(theirs)
    # sizes must agree; data-side fields (chunking, inference steps, tokenizer) are this run's to choose
    differ = sorted(k for k in ours_fields if ours_fields[k] != their_fields.get(k))
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(k for k in set(state) & set(expected) if tuple(state[k].shape) != tuple(expected[k].shape))
    if missing or unexpected or shapes:
        raise LoongError(f"{where}: its weights do not fit model.policy={spec.name} with this model.preset and "
                         f"model.config (fields that differ: {', '.join(differ) or 'none'}; missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}, other shapes {shapes[:3]})")
    return state


def check_initial_weights(path: Path, spec: PolicySpec, config: PolicyConfig) -> None:
    """``model.init_from``, before anything is written: a lerobot folder must hold a ``spec.name`` policy of the
    model's names and shapes (checked against the model on the meta device), a Loong checkpoint a ``spec.name``
    policy (its shapes are checked at load)."""
    if not path.exists():
        raise LoongError(f"model.init_from={path}: no such file or folder")
    if is_lerobot_folder(path):
        with torch.device("meta"):
            expected = spec.policy_class(config).state_dict()
        _lerobot_initial_state(path, spec, config, expected)
        return
    checkpoint_of_policy(path, spec)


def checkpoint_of_policy(path: Path, spec: PolicySpec) -> Path:
    """The step folder ``model.init_from=path`` names (a run, ``checkpoints`` or step folder), refused unless it
    holds a ``spec`` policy."""
    from loong.core.checkpoint import read_config, resolve_checkpoint

    step_dir = resolve_checkpoint(path)
    saved = read_config(step_dir).get("model", {})
    if saved.get("policy") != spec.name:
        raise LoongError(f"model.init_from={path}: {step_dir} holds a {saved.get('policy')!r} policy, not "
                         f"model.policy={spec.name}")
    return step_dir


def load_initial_weights(model: nn.Module, path: Path, spec: PolicySpec, config: PolicyConfig) -> None:
    """``model.init_from``: the weights of a Loong checkpoint (run, ``checkpoints`` or step folder) or of a lerobot
    policy folder (``config.json`` + ``model.safetensors``) into ``model``, whose policy and config they must
    match."""
    if is_lerobot_folder(path):
        state = _lerobot_initial_state(path, spec, config, model.state_dict())
        model.load_state_dict(state, strict=True)
        return
    import torch.distributed.checkpoint as dcp

    from loong.core.engines.fsdp.checkpoint import check_same_model

    step_dir = checkpoint_of_policy(path, spec)
    state = {"model": model.state_dict()}
    try:
        check_same_model(step_dir, state["model"], allow_missing=False)
    except LoongError as exc:
        raise LoongError(f"model.init_from={path}: does not fit this model.preset / model.config ({exc})") from None
    dcp.load(state, checkpoint_id=str(step_dir))  # in place, into the model's own tensors


def _policy(model: nn.Module) -> VLAPolicy:
    """The policy inside the engine's wrappers (DDP's ``module``, torch.compile's ``_orig_mod``)."""
    while not isinstance(model, VLAPolicy):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"{type(model).__name__} holds no VLAPolicy")
        model = inner
    return model


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
        from loong.embodied.data.mix import check_embodiment_ids

        check_embodiment_ids(cfg.data.embodiment_ids, cfg.model.policy_config())
        lerobot_export_dataset(cfg)  # a dataset of the mix, or exit 2 naming the key and the datasets
        if cfg.train.save_lerobot:
            check_lerobot_export(spec, cfg.model.policy_config())
        if cfg.model.init_from is not None and getattr(cfg.model.policy_config(), "base_model_path", None):
            raise LoongError("model.init_from and model.config.base_model_path: give one (init_from: every weight "
                             "of a checkpoint; base_model_path: the backbone of a Hugging Face VLM folder)")
        check_base_model = getattr(spec.policy_class, "check_base_model", None)
        if check_base_model is not None:
            check_base_model(cfg.model.policy_config())
        if cfg.model.init_from is not None:
            check_initial_weights(Path(cfg.model.init_from).expanduser(), spec, cfg.model.policy_config())
        if cfg.parallel.cp_ulysses * cfg.parallel.cp_ring > 1:
            raise LoongError("parallel.cp_ulysses / parallel.cp_ring: a VLA policy's sequences are short; train it "
                             "data-parallel (parallel.fsdp=full|hybrid|none) without context parallelism")

    # --- data --------------------------------------------------------------------------------
    def setup_data(self) -> None:
        from loong.embodied.data.mix import build_mixture, check_mix

        c, d = self.cfg, self.cfg.data
        self.spec = c.model.spec()
        self.policy_config = c.model.policy_config()
        self.gbs, self.mbs = c.train.global_batch_size, c.train.micro_batch_size
        roots = self._roots()
        # one dataset: the policy's configured embodiment (GR00T's embodiment_tag / embodiment), so that training
        # and inference pick the same rows; a mix: the datasets' positions unless data.embodiment_ids names them
        ids = d.embodiment_ids
        if ids is None and len(roots) == 1:
            ids = [int(getattr(self.policy_config, "embodiment_id", 0))]
        # values stay raw in the mixture: the processor normalises each sample with its source's statistics
        # (the sample's dataset_index picks them)
        self.mixture = build_mixture([str(r) for r in roots], d.weights, chunk_size=self.policy_config.chunk_size,
                                     cameras=d.cameras, embodiment_ids=ids, norm_map=None, on_error=d.on_error,
                                     video_backend=d.video_backend)
        check_mix(self.mixture.sources)
        self.dataset = self.mixture.sources[0]
        self.processor = self._processor(self.mixture, None if len(roots) == 1 and d.embodiment_ids is None
                                         else self.mixture.embodiment_ids)
        self.device = self.accelerator.device(self.layout.local_rank)
        self._train_loader: Any = None
        self._train_iter: Iterator[dict] | None = None
        self._train_next: tuple[int, int] | None = None
        self._data_wait_s = 0.0
        if self.layout.is_logging_rank:
            shares = self.mixture.stream(0).weights.tolist()
            for ds, emb, share in zip(self.mixture.sources, self.mixture.embodiment_ids, shares, strict=True):
                print(f"embodied data: {ds.root}: {ds.num_episodes} episodes, {len(ds)} frames, cameras "
                      f"{', '.join(ds.camera_keys)}, state {ds.state_dim}, action {ds.action_dim}, {len(ds.tasks)} "
                      f"task(s), embodiment {emb}, share {share:.3f}", file=sys.stderr)

    def _processor(self, mixture: Any, embodiment_ids: list[int] | None) -> PolicyProcessor:
        """The policy's processor of the mixture's datasets (``from_datasets``: per-source statistics); a processor
        class with only ``from_dataset`` takes one dataset."""
        cls = self.spec.processor_class
        if hasattr(cls, "from_datasets"):
            return cls.from_datasets(self.policy_config, mixture.sources, embodiment_ids)
        if len(mixture.sources) > 1:
            raise LoongError(f"data.repo_root: {len(mixture.sources)} datasets; model.policy={self.spec.name}'s "
                             "processor takes one dataset's statistics (it has no from_datasets)")
        return cls.from_dataset(self.policy_config, mixture.sources[0])

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
            # a policy that starts from a pretrained backbone (GR00T N1.7's model.config.base_model_path)
            load_base_model = getattr(model, "load_base_model", None)
            if load_base_model is not None:
                load_base_model()
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

    @classmethod
    def cuda_graph_unsupported(cls, cfg: Any) -> str | None:
        policy = cfg.model.spec().policy_class
        if not policy.cuda_graph_safe:
            return f"model.policy={policy.name}: its training step is not declared capture-safe"
        return None

    def prepare(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        """Seed this micro-batch's draws (noise and time, whatever the layout), then let the policy make the draws
        it takes on the host; the device step (:meth:`loss`) then draws only on the device."""
        inputs = dict(batch)
        torch.manual_seed(inputs.pop(SEED_KEY))
        return _policy(model).host_draws(inputs)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        if SEED_KEY in batch:  # a caller that did not prepare the batch (the engine always does)
            batch = self.prepare(model, batch)
        loss, metrics = model(batch)
        return loss, metrics

    def save_artifacts(self, checkpoint_dir: Path) -> None:
        """The policy folder beside each checkpoint too, so that a step folder copied alone still serves."""
        write_policy_dir(checkpoint_dir / POLICY_DIR, self.spec, self.policy_config, self.processor)

    def export(self, model: nn.Module, out_dir: Path) -> Path | None:
        """``train.save_lerobot``: the trained policy as a lerobot policy folder ``<run>/lerobot/`` (collective:
        every rank gathers, the logging rank writes), for the dataset ``train.save_lerobot_dataset`` names."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.layout.is_logging_rank:
            return None
        from loong.embodied.lerobot_io import export_lerobot

        return export_lerobot(self.spec.name, self.policy_config, dict(state), self.processor,
                              out_dir.parent / "lerobot", source=lerobot_export_dataset(self.cfg))

    # --- accounting --------------------------------------------------------------------------
    def tokens_per_step(self) -> int:
        """Samples (frames with their action chunks) per global batch: the progress bar's "tok/s" counts samples."""
        return self.gbs


__all__ = ["EVAL_OFFSET", "POLICY_DIR", "POLICY_JSON", "SEED_KEY", "VLATask", "check_initial_weights",
           "check_lerobot_export", "is_lerobot_folder", "draw_seed", "lerobot_export_dataset",
           "load_initial_weights", "write_policy_dir"]
