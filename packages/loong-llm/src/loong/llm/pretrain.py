"""The ``llm.pretrain`` task: next-token prediction on packed text through the megatron engine."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from loong.core.engines.megatron.context_parallel import sum_over_cp
from loong.core.engines.megatron.task import MegatronTask
from loong.core.errors import LoongError
from loong.core.registry import TASKS
from loong.llm.data.indexed import build_pretrain_datasets, indexed_blend, uses_indexed_data
from loong.llm.data.text import GlobalBatchSampler, make_microbatch, split_stream, tokenize_corpus
from loong.llm.data.tokenizer import load_tokenizer, packaged_corpus_path
from loong.llm.models.build import build_gpt_model, transformer_config
from loong.llm.models.config import check_model_layout, runs_sequence_parallel, training_flops_per_token


@TASKS.register("llm.pretrain")
class PretrainTask(MegatronTask):
    """Causal language modelling of a dense decoder."""

    engine = "megatron"
    balances_data = False  # fixed-length windows: every sample costs the same

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        if cfg.data.balance.enabled and not cls.balances_data:
            raise LoongError("data.balance.enabled: every pretraining sample has train.seq_length tokens, "
                             "so there is nothing to balance; it applies to variable-length data (task=sft)")
        if cfg.model.init_from_hf is not None:
            from loong.llm import hf

            # The folder defines the model's shape, as with from_pretrained.
            cfg.model = hf.model_config_from_hf(cfg.model.init_from_hf, keep=cfg.model)
        if cfg.model.init_from is not None:
            from loong.llm.checkpoint_init import checkpoint_model_config

            cfg.model = checkpoint_model_config(cfg.model.init_from, keep=cfg.model)  # its shape, as init_from_hf
        p, m = cfg.parallel, cfg.model
        check_model_layout(m, p.tp, p.pp * (p.vpp or 1), cfg.train.seq_length, ep=p.ep, etp=p.etp, cp=p.cp,
                           sequence_parallel=p.sequence_parallel)
        if m.vocab_size % p.tp:
            raise LoongError(f"parallel.tp={p.tp} does not divide model.vocab_size={m.vocab_size}")
        if uses_indexed_data(cfg.data):  # preprocessed shards: the blend and its files
            indexed_blend(cfg.data)
        elif cfg.data.path is not None and not Path(cfg.data.path).exists():
            raise LoongError(f"data.path: {cfg.data.path} does not exist")
        from loong.llm.lora import check_lora_config

        if m.moe_grouped_mm == "auto" and cfg.precision.fp8 != "off":
            m.moe_grouped_mm = False  # FP8 recipes reach the experts only through the loop's linear layers
        if m.is_moe and m.moe_grouped_mm is True and cfg.precision.fp8 != "off":
            raise LoongError(f"model.moe_grouped_mm=true multiplies the experts' weights outside their linear layers, "
                             f"so precision.fp8={cfg.precision.fp8} would not reach them; set model.moe_grouped_mm="
                             "false or precision.fp8=off")
        if m.is_moe and m.lora.rank > 0:
            raise LoongError("model.lora on a mixture-of-experts model is not supported yet (the experts' "
                             "linear layers are not wrapped); set model.lora.rank=0")
        # the one rule of when the model runs sequence-parallel (MoE, refused above, and MLA imply it at tp > 1)
        check_lora_config(m.lora, sequence_parallel=runs_sequence_parallel(m, p.tp, p.sequence_parallel))

    # --- model -----------------------------------------------------------------------------
    def model_config(self, dtype: torch.dtype) -> Any:
        overrides = self.accelerator.megatron_config_overrides()
        return transformer_config(self.cfg.model, self.cfg.parallel, dtype, overrides)

    def build_model(self, config: Any, pre_process: bool, post_process: bool,
                    vp_stage: int | None) -> torch.nn.Module:
        gpt = build_gpt_model(self.cfg.model, config, self.accelerator.capabilities(), pre_process,
                              post_process, self.layout.pg_collection, vp_stage)
        if self.cfg.model.lora.rank > 0:
            # Here, not in init_weights: adapters must exist on resume too, and before DDP wraps the model.
            from loong.llm.lora import apply_lora

            apply_lora([gpt], self.cfg.model.lora, seed=self.cfg.train.seed)
        if self.cfg.model.is_dsa and self.cfg.model.dsa_stage == "dense_warmup":
            # DeepSeek-V3.2's dense warm-up trains only the lightning indexers (before DDP wraps the model)
            from loong.llm.models.deepseek_v32.indexer import freeze_all_but_indexer

            freeze_all_but_indexer(gpt)
        return gpt

    def after_train_step(self, step: int, extra: dict[str, float]) -> dict[str, float]:
        """MoE: the step's load-balancing loss (megatron's ``load_balancing_loss``, DeepSeek's sequence-wise
        ``seq_load_balancing_loss``: per MoE layer, summed over micro-batches, then averaged over the
        micro-batches, the MoE layers and data parallelism), unweighted by ``moe_aux_loss_coeff``. Its gradient
        already reached the router through ``MoEAuxLossAutoScaler`` (the pipeline schedule sets its scale); the
        logged ``loss`` stays the language-model loss. Multi-token prediction: ``mtp_loss``, the MTP modules'
        cross-entropy (mean over modules, micro-batches and DP), whose gradient ``MTPLossAutoScaler`` added.
        DeepSeek-V3.2: ``indexer_loss``, the lightning indexers' KL (mean over DSA layers, micro-batches and DP),
        unweighted by ``indexer_loss_coeff``; its gradient came through ``IndexerLossAutoScaler``."""
        m = self.cfg.model
        out: dict[str, float] = {}
        nmb = self.num_train_microbatches(step, self._num_microbatches())
        if m.is_moe and m.moe_aux_loss_coeff > 0:
            from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

            tracker = get_moe_metrics_tracker()
            name = "seq_load_balancing_loss" if m.is_mla else "load_balancing_loss"
            tracker.ensure_initialized(name, m.num_layers, device=self.accelerator.device(self.layout.local_rank))
            totals: dict = {}
            tracker.report(loss_scale=1.0 / nmb, iteration=step, track_names=[name], num_layers=m.num_layers,
                           total_loss_dict=totals, pg_collection=self.layout.pg_collection)
            value = totals.get(name)
            if value is not None:
                out["moe_aux_loss"] = float(value)
        if m.mtp_num_layers:
            out.update(self._mtp_loss(nmb))
        if m.is_dsa:
            from loong.llm.models.deepseek_v32.indexer import indexer_loss_report

            out.update(indexer_loss_report(self.layout.pg_collection, self.accelerator.device(self.layout.local_rank)))
        return out

    def _mtp_loss(self, num_microbatches: int) -> dict[str, float]:
        # megatron's own reduction averages with ReduceOp.AVG, which gloo lacks: sum over DP (x CP: a CP rank's
        # value is its share of the sequences' mean times the CP size, see LoongGPTModel._mtp_loss) and divide here
        import torch.distributed as dist
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker
        values = tracker.get("loss_values")
        if values is None:  # not the last pipeline stage
            return {}
        total = values.detach().clone()
        pgs = self.layout.pg_collection
        dp = getattr(pgs, "dp_cp", None) or getattr(pgs, "dp", None)
        if dp is not None and dist.get_world_size(dp) > 1:
            dist.all_reduce(total, group=dp)
            total /= dist.get_world_size(dp)
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        return {"mtp_loss": float(total.mean()) / num_microbatches}

    def _num_microbatches(self) -> int:
        from loong.core.engines.base import num_microbatches

        return num_microbatches(self.cfg, self.layout.dp)

    def init_weights(self, model_chunks: list[torch.nn.Module]) -> None:
        if self.cfg.model.init_from_hf is not None:
            from loong.llm import hf

            hf.load_hf_into(model_chunks, self.cfg.model.init_from_hf, self.cfg.model)
        if self.cfg.model.init_from is not None:
            from loong.llm.checkpoint_init import load_checkpoint_into

            load_checkpoint_into(model_chunks, self.cfg.model)

    # --- data ------------------------------------------------------------------------------
    def setup_data(self) -> None:
        d, t = self.cfg.data, self.cfg.train
        self.tokenizer = load_tokenizer(d.tokenizer)
        if self.tokenizer.vocab_size > self.cfg.model.vocab_size:
            raise LoongError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is "
                f"{self.cfg.model.vocab_size}"
            )
        if uses_indexed_data(d):  # preprocessed shards through megatron-core's GPTDataset (pre-shuffled)
            self.train_data, self.valid_data = build_pretrain_datasets(self.cfg, self.tokenizer)
        else:  # a text/JSONL file tokenised on the fly
            path = Path(d.path) if d.path is not None else packaged_corpus_path()
            tokens = tokenize_corpus(path, self.tokenizer, d.format, d.text_field)
            self.train_data, self.valid_data = split_stream(tokens, t.seq_length, d.valid_fraction, str(path))
        self.sampler = GlobalBatchSampler(len(self.train_data), t.seed)
        self.device = self.accelerator.device(self.layout.local_rank)

    def _batches(self, indices: Iterator[int], data: Any, nmb: int) -> Iterator[dict]:
        mbs = self.cfg.train.micro_batch_size
        for _ in range(nmb):
            batch = make_microbatch([data[next(indices)] for _ in range(mbs)])
            if self.layout.cp > 1:  # this CP rank's two zigzag chunks of every sequence
                from loong.core.engines.megatron.context_parallel import split_for_cp_rank

                cp = self.layout.pg_collection.cp
                batch = {k: split_for_cp_rank(v, 1, cp.size(), cp.rank()) for k, v in batch.items()}
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _rank_offset(self, nmb: int) -> int:
        return self.layout.dp_rank * nmb * self.cfg.train.micro_batch_size

    def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict]:
        start = step * self.cfg.train.global_batch_size + self._rank_offset(num_microbatches)
        if getattr(self.train_data, "shuffled", False):  # megatron's order: sample g is index g
            n = len(self.train_data)
            indices = (g % n for g in range(start, start + 10**12))
        else:
            indices = (self.sampler.index(g) for g in range(start, start + 10**12))
        return self._batches(indices, self.train_data, num_microbatches)

    def eval_microbatches(self, index: int, num_microbatches: int) -> Iterator[dict]:
        n = len(self.valid_data) or len(self.train_data)
        data = self.valid_data if len(self.valid_data) else self.train_data
        start = index * self.cfg.train.global_batch_size + self._rank_offset(num_microbatches)
        return self._batches((g % n for g in range(start, start + 10**12)), data, num_microbatches)

    # --- loss ------------------------------------------------------------------------------
    def _loss(self, loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        losses = output.float()
        # each CP rank holds part of every sequence: divide by the whole sequences' token count. megatron's schedule
        # multiplies the loss by cp (its DDP averages gradients over dp x cp), and the engine averages the logged
        # loss over dp x cp, so the logged value is scaled alike here.
        count = sum_over_cp(loss_mask.sum(), getattr(self.layout.pg_collection, "cp", None))
        loss = (losses * loss_mask).sum() / count.clamp(min=1)
        # a new tensor (the product): the schedule divides the returned loss in place by the micro-batch count
        return loss, {"loss": loss.detach() * self.layout.cp}

    def forward_step(self, data_iterator: Iterator[dict], model: torch.nn.Module) -> tuple[Any, Any]:
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(self._loss, batch["loss_mask"])

    # --- accounting and artefacts ----------------------------------------------------------
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.cfg.train.seq_length

    def flops_per_token(self) -> float:
        return training_flops_per_token(self.cfg.model, self.cfg.train.seq_length)

    def memory_hints(self) -> list[str]:
        m = self.cfg.model
        hints = []
        if m.recompute != "full":
            hints.append("model.recompute=full (each layer's activations recomputed in the backward; "
                         "model.recompute_num_layers groups them)")
        if m.fused_kernels == "off":
            hints.append("model.fused_kernels=auto (the fused linear + cross-entropy keeps no [tokens, vocab] logits)")
        if m.family == "deepseek_v32" and m.dsa_head_chunks == 1:
            hints.append("model.dsa_head_chunks=8 (the sparse attention core per head group, recomputed: no "
                         "[tokens, heads, 576] query kept per layer)")
        return hints

    def save_artifacts(self, checkpoint_dir: Path) -> None:
        self.tokenizer.save(checkpoint_dir / "tokenizer")

    def export(self, model_chunks: list[torch.nn.Module], out_dir: Path) -> Path | None:
        from loong.llm import hf

        return hf.export_model(model_chunks, self.cfg.model, out_dir, tokenizer=self.tokenizer)
