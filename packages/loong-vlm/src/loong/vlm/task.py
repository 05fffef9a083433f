"""The ``vlm.sft`` task: a vision-language model trained on conversations with images and videos, on the megatron
engine (the foundation is loong-llm's megatron GPT; the vision tower runs on the chunk with the embedding, or with
``encoder.decoupled=true`` at pp > 1 outside the pipeline schedule on every stage: :mod:`loong.vlm.models.decoupled`).

Data: :mod:`loong.vlm.data` reads the JSONL (or writes the synthetic shapes set of the embedded default), plans
every sample from its media headers, packs samples into rows of ``train.seq_length`` and decodes the media in
DataLoader workers. The loss is the per-token mean over the assistant tokens of the whole global batch (megatron-core's
``calculate_per_token_loss``, as loong-llm's SFT): every learned token weighs the same wherever it falls.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from loong.core.engines.megatron.task import MegatronTask
from loong.core.errors import LoongError
from loong.core.registry import TASKS
from loong.llm.data.text import GlobalBatchSampler
from loong.llm.models.config import check_model_layout, training_flops_per_token
from loong.llm.sft.task import SFTTask
from loong.vlm.models.families import vision_family
from loong.vlm.models.vision.common import host_to_device
from loong.vlm.schema import COMPONENTS, VLMRunConfig

#: batch keys handed to the model besides tokens / positions / document ids / labels
MEDIA_KEYS = ("mm_token_type_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
              "media_tokens")
#: batch keys that stay on the host: small metadata the model reads as Python numbers (the grids shape the
#: vision tower's index tensors); on the device each read would be a device-to-host sync inside the forward
HOST_KEYS = ("image_grid_thw", "video_grid_thw", "media_tokens")


def check_vlm_config(cfg: VLMRunConfig) -> None:
    """What the three components must agree on, before anything heavy starts."""
    enc, proj, fnd, m = cfg.encoder, cfg.projector, cfg.foundation, cfg.model
    vision_family(enc.family, proj.family)
    if proj.out_hidden_size != fnd.hidden_size:
        raise LoongError(f"projector.out_hidden_size={proj.out_hidden_size} must equal foundation.hidden_size="
                         f"{fnd.hidden_size} (the projector writes the foundation's embeddings)")
    if m.mrope_section is not None:
        from loong.vlm.models.foundation import check_mrope

        check_mrope(m.mrope_section, m.mrope_interleaved, fnd.kv_channels, path="model")
        if fnd.is_mla:
            raise LoongError(f"model.mrope_section={m.mrope_section}: foundation.family={fnd.family} uses "
                             "multi-latent attention with its own rotary embedding; set model.mrope_section=null")
    elif cfg.data.positions == "mrope":
        raise LoongError("data.positions=mrope needs model.mrope_section (the foundation's M-RoPE layout)")
    if enc.deepstack_visual_indexes and fnd.recompute == "full":
        raise LoongError("encoder.deepstack_visual_indexes (DeepStack) with foundation.recompute=full is not "
                         "supported; use foundation.recompute=selective or none")
    p = cfg.parallel
    if enc.decoupled and p.vpp:
        raise LoongError(f"encoder.decoupled=true with parallel.vpp={p.vpp} is not supported (the tower's replicas "
                         "are placed one per pipeline rank, not per virtual stage); drop parallel.vpp")
    check_model_layout(fnd, p.tp, p.pp * (p.vpp or 1), cfg.train.seq_length, ep=p.ep, etp=p.etp, cp=p.cp,
                       sequence_parallel=p.sequence_parallel)  # rows that CP / SP cannot split too
    if fnd.vocab_size % p.tp:
        raise LoongError(f"parallel.tp={p.tp} does not divide foundation.vocab_size={fnd.vocab_size}")
    if p.cp > 1:
        if enc.decoupled:
            raise LoongError(f"encoder.decoupled=true with parallel.cp={p.cp} is not supported (the tower's replicas "
                             "are placed per pipeline rank and summed over it, not over context parallelism); "
                             "drop one of them")
        if cfg.data.balance.enabled:
            raise LoongError(f"data.balance.enabled=true with parallel.cp={p.cp} is not supported (balanced "
                             "micro-batches vary in length, CP splits fixed-length rows); use one of them")
    from loong.core.engines.megatron.layout import check_component_tp
    from loong.vlm.models.vision.tensor_parallel import check_encoder_tp

    check_component_tp("encoder", enc.parallel.tp, p.tp)
    check_encoder_tp(enc, enc.parallel.tp)
    if cfg.data.path is not None and not Path(cfg.data.path).is_file():
        raise LoongError(f"data.path: {cfg.data.path} is not a file")
    if cfg.data.processor is not None and not Path(cfg.data.processor).is_dir():
        raise LoongError(f"data.processor: {cfg.data.processor} is not a folder")
    if cfg.data.balance.enabled and p.pp > 1:
        raise LoongError("data.balance.enabled=true plans micro-batches of varying shape, which the pipeline "
                         f"schedule does not take (parallel.pp={p.pp}); use pp=1")


def _in_component(component: str, param: torch.nn.Parameter, name: str) -> bool:
    """Whether parameter ``name`` (as named under the DDP / Float16Module wrappers) belongs to ``component``."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name.split(".", 1)[0] == component


@TASKS.register("vlm.sft")
class VLMTask(MegatronTask):
    """Supervised training of a VLM (encoder + projector + foundation) on image / video conversations."""

    engine = "megatron"

    @classmethod
    def component_layouts(cls, cfg: Any) -> dict[str, int]:
        """The vision encoder's own tensor-parallel size (``encoder.parallel.tp``, dividing ``parallel.tp``)."""
        return {"encoder": cfg.encoder.parallel.tp}

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        from loong.vlm.convert import adopt_resume_checkpoint
        from loong.vlm.hf import adopt_init_from_hf
        from loong.vlm.hf_config import VLMParts, check_parts

        if cfg.foundation.init_from is not None:
            from loong.llm.checkpoint_init import checkpoint_model_config

            if cfg.model.init_from_hf is not None:
                raise LoongError("foundation.init_from and model.init_from_hf both name the foundation's starting "
                                 "weights; give one")
            # a loong-llm checkpoint sets the foundation's shape (as an HF folder does for init_from_hf)
            cfg.foundation = checkpoint_model_config(cfg.foundation.init_from, keep=cfg.foundation,
                                                     key="foundation.init_from")
        adopt_init_from_hf(cfg)  # the folder (model.init_from_hf) or the checkpoint (train.resume) sets the shapes
        adopt_resume_checkpoint(cfg)
        check_vlm_config(cfg)
        if cfg.train.save_hf:
            check_parts(VLMParts.of(cfg), "train.save_hf")

    def init_weights(self, model_chunks: list[torch.nn.Module]) -> None:
        if self.cfg.model.init_from_hf is not None:
            from loong.vlm.hf import load_hf_into
            from loong.vlm.hf_config import VLMParts

            load_hf_into(model_chunks, self.cfg.model.init_from_hf, VLMParts.of(self.cfg))
        if self.cfg.foundation.init_from is not None:
            from loong.llm.checkpoint_init import load_checkpoint_into
            from loong.vlm.hf import FOUNDATION

            load_checkpoint_into(model_chunks, self.cfg.foundation, prefix=FOUNDATION, key="foundation.init_from")

    # --- model -----------------------------------------------------------------------------
    def model_config(self, dtype: torch.dtype) -> Any:
        from loong.llm.models.build import transformer_config

        config = transformer_config(self.cfg.foundation, self.cfg.parallel, dtype,
                                    self.accelerator.megatron_config_overrides())
        config.calculate_per_token_loss = True  # gradients / all assistant tokens of the global batch
        self._megatron_config = config  # the engine's: its finalize_model_grads_func is wrapped when decoupled
        return config

    def build_model(self, config: Any, pre_process: bool, post_process: bool,
                    vp_stage: int | None) -> torch.nn.Module:
        from loong.vlm.models.foundation import build_foundation
        from loong.vlm.models.vlm import VisionLanguageModel

        c, m = self.cfg, self.cfg.model
        deepstack = len(c.encoder.deepstack_visual_indexes) if c.projector.family == "qwen3_merger" else 0
        foundation = build_foundation(c.foundation, config, self.accelerator.capabilities(), pre_process,
                                      post_process, self.layout.pg_collection, vp_stage, m.mrope_section,
                                      m.mrope_interleaved, deepstack_layers=deepstack)
        encoder = projector = None
        decoupled = c.encoder.decoupled and c.parallel.pp > 1
        replica = 0
        if decoupled and not pre_process:  # a replica of the tower on every later pipeline rank
            replica = torch.distributed.get_rank(self.layout.pg_collection.pp)
        if pre_process or decoupled:
            from loong.core.attention import choose_varlen_impl

            family = vision_family(c.encoder.family, c.projector.family).load()
            # the same initial weights on every rank: the tower is replicated over the foundation's TP group (and,
            # decoupled, over its pipeline stages)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(c.train.seed)
                encoder = family.build_encoder(c.encoder)
                projector = family.build_projector(c.projector, c.encoder)
            if hasattr(encoder, "attn_impl"):
                encoder.attn_impl = choose_varlen_impl(self.accelerator.capabilities())
            if c.encoder.parallel.tp > 1:
                self._shard_encoder(encoder)
            if decoupled:  # every replica's gradient joins the pipeline-group sum (DecoupledTower.sum_replica_grads)
                for param in (*encoder.parameters(), *projector.parameters()):
                    # megatron's gradient norm (clipping) sums over the pipeline group: count the tower once, as
                    # it does the tied output weight (``shared`` on the duplicate)
                    param.shared = replica > 0 or getattr(param, "shared", False)
        model = VisionLanguageModel(config, foundation, encoder, projector, tower_replica=replica)
        self._freeze(model)
        if decoupled:
            from loong.vlm.models.decoupled import DecoupledTower

            self.tower = DecoupledTower(model, self.layout.pg_collection.pp, c.projector.out_hidden_size, deepstack)
        return model

    def _shard_encoder(self, encoder: torch.nn.Module) -> None:
        """``encoder.parallel.tp > 1``: shard the blocks over the encoder's process group (built by the layout, a
        block of consecutive ranks of the foundation's tensor-parallel group); the other blocks of that group hold
        replicas of the sharded encoder (numbered for the gradient norm and the checkpoint)."""
        from loong.vlm.models.vision.tensor_parallel import shard_vision_encoder

        group = self.layout.component("encoder").tp
        replica = torch.distributed.get_rank(self.layout.pg_collection.tp) // group.size()
        shard_vision_encoder(encoder, group, replica)

    def _freeze(self, model: torch.nn.Module) -> None:
        """``model.freeze``: those components' parameters take no gradient (megatron's optimiser then keeps no
        state for them)."""
        for name in self.cfg.model.freeze:
            part = getattr(model, name, None)
            if part is not None:
                part.requires_grad_(False)

    def optimizer_overrides(self, lr: float, min_lr: float) -> dict[Any, Any]:
        """``model.lr_mult``: the parameters of each component whose multiplier is not 1 in a group whose peak and
        minimum learning rates are ``lr`` / ``min_lr`` times it (megatron's scheduler anneals every group on the
        same schedule between its own ``max_lr`` and ``min_lr``)."""
        from megatron.core.optimizer import ParamKey, ParamWithNamePredicate

        out: dict[Any, Any] = {}
        for name in COMPONENTS:
            mult = getattr(self.cfg.model.lr_mult, name)
            if float(mult) == 1.0:
                continue
            key = ParamKey(with_name_predicate=ParamWithNamePredicate(
                name=f"vlm_{name}", fn=partial(_in_component, name)))
            out[key] = {"max_lr": lr * float(mult), "min_lr": min_lr * float(mult)}
        return out

    # --- data ------------------------------------------------------------------------------
    def _cache_dir(self) -> Path:
        return Path(self.cfg.output_dir) / ".cache"

    def _processor(self) -> Any:
        from loong.vlm.data.processors import ensure_tiny_processor, load_processor, tiny_processor_shape

        d = self.cfg.data
        folder = d.processor
        if folder is None:
            family, shape = tiny_processor_shape(self.cfg.encoder, self.cfg.projector)
            folder = ensure_tiny_processor(self._cache_dir(), family, **shape)
        return load_processor(folder, chat_template=d.chat_template, min_pixels=d.min_pixels,
                              max_pixels=d.max_pixels, video_min_pixels=d.video_min_pixels,
                              video_max_pixels=d.video_max_pixels, max_tiles=d.max_tiles, fps=d.fps,
                              max_frames=d.max_frames)

    def setup_data(self) -> None:
        from loong.vlm.data.dataset import prepare_vision_data
        from loong.vlm.data.rope_index import scheme_for
        from loong.vlm.data.synthetic import ensure_synthetic

        c, d, t = self.cfg, self.cfg.data, self.cfg.train
        self.processor = self._processor()
        if self.processor.vocab_size > c.foundation.vocab_size:
            raise LoongError(f"the processor's tokenizer has {self.processor.vocab_size} tokens but "
                             f"foundation.vocab_size is {c.foundation.vocab_size}")
        positions = d.positions if c.model.mrope_section is not None else "1d"
        self.scheme = scheme_for(self.processor.family, self.processor.merge_size if self.processor.is_qwen else 1,
                                 positions, c.encoder.tokens_per_second)
        path = Path(d.path) if d.path is not None else ensure_synthetic(self._cache_dir(), d.synthetic_size,
                                                                        d.synthetic_seed)
        self.data_path = path
        self.data = prepare_vision_data(path, self.processor, self.scheme, t.seq_length, packing=d.packing,
                                        overlong=d.overlong, on_error=d.on_error, chat_format=d.chat_format,
                                        media_root=d.media_root, valid_fraction=d.valid_fraction)
        self.sampler = GlobalBatchSampler(len(self.data.train), t.seed)
        self.device = self.accelerator.device(self.layout.local_rank)
        self._train_iter: Iterator[dict] | None = None
        self._train_next: int | None = None
        self.skipped_samples = 0
        self.balanced = None
        if d.balance.enabled:
            from loong.vlm.data.balance import BalancedVisionSamples

            self.balanced = BalancedVisionSamples(c, self.data.train, self.sampler, self.layout.dp,
                                                  self.layout.pg_collection.dp)
        if c.train.save_hf:  # the processor must fit the HF folder: refuse it now, not after training
            from loong.vlm.hf_config import VLMParts, hf_config_of

            hf_config_of(VLMParts.of(c), self.processor)
        if self.layout.is_logging_rank:
            print(self.data.summary(path), file=sys.stderr)

    def _global_rows(self, step: int, n: int, shuffled: bool) -> list[int]:
        """The row indices of global batch ``step`` over ``n`` rows: the seeded sampler's (training) or in order."""
        gbs = self.cfg.train.global_batch_size
        pick = self.sampler.index if shuffled else (lambda g: g % n)
        return [pick(g) for g in range(step * gbs, (step + 1) * gbs)]

    def _rows(self, step: int, nmb: int, n: int, shuffled: bool) -> list[list[int]]:
        """This rank's micro-batches (row indices) of global batch ``step`` over ``n`` rows."""
        mbs = self.cfg.train.micro_batch_size
        rows = self._global_rows(step, n, shuffled)
        first = self.layout.dp_rank * nmb * mbs
        return [rows[first + k * mbs: first + (k + 1) * mbs] for k in range(nmb)]

    def _scale(self, packed: Any, step: int, nmb: int, shuffled: bool) -> float:
        """The loss scale making the engine's mean over ``nmb`` micro-batches and DP ranks the global batch's
        per-token mean (as loong-llm's SFT)."""
        tokens = int(sum(packed.loss_tokens[i] for i in self._global_rows(step, len(packed), shuffled)))
        return float(nmb * self.layout.dp / max(1, tokens))

    def _loader(self, dataset: Any, first_step: int, nmb: int, shuffled: bool, workers: int) -> Iterator[dict]:
        from loong.vlm.data.dataset import vision_loader

        n = len(dataset)

        def schedule() -> Iterator[list[int]]:
            step = first_step
            while True:
                yield from self._rows(step, nmb, n, shuffled)
                step += 1

        return iter(vision_loader(dataset, schedule(), num_workers=workers))

    @property
    def document_ids(self) -> bool:
        """Whether the foundation gets per-token document ids. With ``data.packing=false`` every row is one
        sample and then padding (balanced micro-batches too): plain causal attention (SDPA's flash / cuDNN
        kernels) gives every real token the same output as the document mask (no real token attends to the
        padding after it; padding carries no loss), so the ids are dropped, decided from the config on the
        host. Packed rows keep them."""
        return self.cfg.data.packing

    def _to_device(self, batch: dict, scale: float) -> dict:
        from loong.vlm.models.vlm import media_token_counts

        self.skipped_samples += int(batch.pop("skipped_samples", 0))
        if not self.document_ids:
            batch.pop("document_ids", None)
        batch["media_tokens"] = media_token_counts(batch["mm_token_type_ids"])  # on the CPU batch: no sync
        if self.layout.cp > 1:
            batch = self._cp_slice(batch)
            # the engine averages the reported loss over dp x cp, and each CP rank reports its chunks' share
            scale *= self.layout.cp
        # through pinned memory: a copy from pageable memory would make the host wait for the stream
        out = {k: v if k in HOST_KEYS else host_to_device(v, self.device) for k, v in batch.items()}
        out["loss_scale"] = torch.full((), scale, dtype=torch.float32, device=self.device)  # a fill, no copy
        return out

    def _cp_slice(self, batch: dict) -> dict:
        """This CP rank's two zigzag chunks of every per-token row (tokens, labels, loss mask, document ids,
        position ids ``[b, s]`` or M-RoPE ``[3, b, s]``). The media and ``mm_token_type_ids`` stay whole: every CP
        rank runs the encoder on all of the micro-batch's media (the visual rows are numbered over the whole rows)
        and places the rows that fall in its chunks; the encoder's gradients, each rank's share, are summed over
        dp x cp like every other parameter's."""
        from loong.core.engines.megatron.context_parallel import split_for_cp_rank

        cp = self.layout.pg_collection.cp
        out = dict(batch)
        for key in ("tokens", "labels", "loss_mask", "document_ids", "position_ids"):
            if key in out:
                out[key] = split_for_cp_rank(out[key], out[key].dim() - 1, cp.size(), cp.rank())
        return out

    def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict]:
        train, workers = self.data.train, self.cfg.data.num_workers
        if self._train_iter is None or self._train_next != step:  # first step, or a resumed / skipped one
            if self.balanced is not None:
                self._train_iter = self.balanced.loader(step, self.layout.dp_rank, workers)
            else:
                self._train_iter = self._loader(train, step, num_microbatches, True, workers)
        self._train_next = step + 1
        if self.balanced is not None:  # the per-token mean over the same assistant tokens, as unbalanced
            scale = num_microbatches * self.layout.dp / max(1, self.balanced.loss_tokens(step))
        else:
            scale = self._scale(train.packed, step, num_microbatches, True)
        batches = [self._to_device(next(self._train_iter), scale) for _ in range(num_microbatches)]
        if getattr(self, "tower", None) is not None:
            self._decoupled_step(batches)
        return iter(batches)

    def _decoupled_step(self, batches: list[dict]) -> None:
        """``encoder.decoupled`` at pp > 1: the tower embeds the step's micro-batches on every pipeline rank
        before the schedule (:mod:`loong.vlm.models.decoupled`); its backward and the replicas' pipeline-group
        gradient sum run just before megatron reduces the gradients over data parallelism (inside the schedule's
        ``finalize_model_grads_func``, wrapped once here)."""
        self.tower.forward(batches)
        config = self._megatron_config
        reduce = config.finalize_model_grads_func
        if not getattr(reduce, "vlm_tower_backward", False):
            def finalize(*args: Any, **kwargs: Any) -> Any:
                self.tower.backward()
                self.tower.sum_replica_grads()
                return reduce(*args, **kwargs)

            finalize.vlm_tower_backward = True  # type: ignore[attr-defined]
            config.finalize_model_grads_func = finalize

    def eval_microbatches(self, index: int, num_microbatches: int) -> Iterator[dict]:
        data = self.data.valid if len(self.data.valid) else self.data.train
        loader = self._loader(data, index, num_microbatches, False, 0)
        scale = self._scale(data.packed, index, num_microbatches, False)
        return iter([self._to_device(next(loader), scale) for _ in range(num_microbatches)])

    # --- loss ------------------------------------------------------------------------------
    def forward_step(self, data_iterator: Iterator[dict], model: torch.nn.Module) -> tuple[Any, Any]:
        batch = next(data_iterator)
        media = {k: batch[k] for k in (*MEDIA_KEYS, "visual_embeds", "deepstack_embeds") if k in batch}
        output = model(batch["tokens"], batch["position_ids"], batch.get("document_ids"), labels=batch["labels"],
                       **media)
        return output, partial(SFTTask._loss, batch["loss_mask"], loss_scale=batch["loss_scale"])

    # --- data-parallel balancing (core hooks; loong.vlm.data.balance) -------------------------------------
    def num_train_microbatches(self, step: int, default: int) -> int:
        return self.balanced.plan(step)[0].num_micro_batches if self.balanced is not None else default

    def measures_compute_time(self) -> bool:
        return self.balanced is not None and self.balanced.balancer.measures_time

    def after_train_step(self, step: int, extra: dict[str, float]) -> dict[str, float]:
        metrics = {"skipped_samples": float(self.skipped_samples)} if self.skipped_samples else {}
        if self.balanced is None:
            return metrics
        metrics.update(self.balanced.step_metrics(step))
        if "compute_s" in extra:
            fitted = self.balanced.balancer.observe(self.balanced.plan(step)[0], extra["compute_s"], self.device)
            if fitted and self.layout.is_logging_rank:
                terms = " + ".join(f"{fitted[f'balance_cost_{k}']:.3g}*{t}" for k, t in
                                   (("a", "len^2"), ("b", "len"), ("enc_a", "enc^2"), ("enc_b", "enc"))
                                   if f"balance_cost_{k}" in fitted)
                print(f"data.balance: fitted cost = {terms} + {fitted['balance_cost_c']:.3g} seconds",
                      file=sys.stderr)
            metrics.update(fitted)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"balance": self.balanced.balancer.state_dict()} if self.balanced is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.balanced is not None:
            self.balanced.balancer.load_state_dict(state.get("balance", {}))

    # --- accounting and artefacts ----------------------------------------------------------
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.cfg.train.seq_length

    def flops_per_token(self) -> float:
        """The foundation's training FLOPs per token (:func:`~loong.llm.models.config.training_flops_per_token`) plus
        the vision tower's, averaged over the training rows: 3 × its forward FLOPs (the family's ``encoder_flops``)
        over every row's media, divided by the rows' token slots."""
        base = training_flops_per_token(self.cfg.foundation, self.cfg.train.seq_length)
        family = vision_family(self.cfg.encoder.family).load()
        samples = self.data.train.packed.samples
        total = 0.0
        for kind in ("image", "video"):
            grids = [g for s in samples for g in s.grids(kind).tolist()]
            if grids:
                if self.cfg.encoder.family == "intern_vit":
                    total += sum(family.encoder_flops(self.cfg.encoder, [g[0] for g in grids]))
                else:
                    total += sum(family.encoder_flops(self.cfg.encoder, grids))
        slots = max(1, len(self.data.train) * self.cfg.train.seq_length)
        return base + 3.0 * total / slots

    def save_artifacts(self, checkpoint_dir: Path) -> None:
        self.processor.hf.save_pretrained(str(checkpoint_dir / "processor"))

    def export(self, model_chunks: list[torch.nn.Module], out_dir: Path) -> Path | None:
        """``train.save_hf``: the family's HF folder (weights gathered from every rank, written on rank 0) with the
        processor beside it (its tokenizer gives the config's placeholder token ids)."""
        from loong.vlm.hf import export_model
        from loong.vlm.hf_config import VLMParts

        return export_model(model_chunks, VLMParts.of(self.cfg), out_dir, self.processor)
