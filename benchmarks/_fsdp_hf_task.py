"""The fsdp-engine task of ``benchmarks/fsdp_engine.py``: HF's ``LlamaForCausalLM`` trained as it is.

The model is built by ``llm_throughput.hf_model`` (the HF row's own builder: the same config, seed and weights),
optionally with loong-kernels' fused modules swapped in (:mod:`loong.llm.hf_fused`); the data are the HF row's
windows in its order (``llm_throughput.corpus_windows`` / ``microbatch``) and the loss is its loss
(``llm_throughput.lm_loss``, or the same cross-entropy from the fused head). Imported by the benchmark's worker
process only: the parent process stays free of torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from llm_throughput import corpus_windows, hf_model, lm_loss, microbatch
from torch import nn

from loong.core.config.schema import RunConfig
from loong.core.engines.fsdp.task import FSDPTask
from loong.core.registry import TASKS
from loong.llm.data.text import GlobalBatchSampler, PackedTokens
from loong.llm.hf_fused import fuse_llama, fused_head, fused_lm_loss, resolve_hf_fused_kernels
from loong.llm.models.config import DenseModelConfig, training_flops_per_token
from loong.llm.models.fused import FusedKernels


@dataclass
class HFLlamaRunConfig(RunConfig):
    """A run of :class:`HFLlamaTask`. ``model`` is loong-llm's model config (the preset's shape; ``fused_kernels``
    picks loong-kernels' modules for the HF model, ``recompute`` the fsdp engine's recomputation);
    ``fused_reference`` swaps every fused module in with the kernels' plain-PyTorch references, wherever Triton is
    missing too (a CPU check of the wiring)."""

    task: str = "bench.hf_llama"
    engine: str = "fsdp"
    model: DenseModelConfig = field(default_factory=DenseModelConfig)
    fused_reference: bool = False


@TASKS.register("bench.hf_llama")
class HFLlamaTask(FSDPTask):
    """Next-token prediction with HF's ``LlamaForCausalLM`` on loong-llm's tokenised corpus (``data.path``)."""

    def setup_data(self) -> None:
        t = self.cfg.train
        self.train, self.valid, self.order = corpus_windows(self.cfg.data, self.cfg.data.path, t.seq_length, t.seed)

    def build_model(self) -> nn.Module:
        model = hf_model(self.cfg.model, self.cfg.train.seed)
        if self.cfg.fused_reference:
            plan = FusedKernels.everything("reference")
        else:
            plan = resolve_hf_fused_kernels(self.cfg.model.fused_kernels, self.accelerator.capabilities())
        counts = fuse_llama(model, plan)
        if self.layout.is_logging_rank:  # the benchmark reads this line into its row
            print("hf_fused: " + " ".join(f"{k}={v}" for k, v in counts.items()) + f" backend={plan.backend}",
                  flush=True)
        return model

    def _batches(self, windows: PackedTokens, order: GlobalBatchSampler, step: int,
                 num_microbatches: int) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's micro-batches of global batch ``step``: samples ``step * gbs + dp_rank * gbs / dp ...`` of
        the order, ``micro_batch_size`` at a time (one rank: the HF row's ``step * gbs + i * mbs``)."""
        gbs = self.cfg.train.global_batch_size
        per_rank = gbs // self.layout.dp
        mbs = per_rank // num_microbatches
        first = step * gbs + self.layout.dp_rank * per_rank
        for i in range(num_microbatches):
            mb = microbatch(windows, order, first + i * mbs, mbs)
            yield {"tokens": mb["tokens"], "labels": mb["labels"]}

    def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict[str, torch.Tensor]]:
        return self._batches(self.train, self.order, step, num_microbatches)

    def eval_microbatches(self, index: int, num_microbatches: int) -> Iterator[dict[str, torch.Tensor]]:
        data = self.valid if len(self.valid) else self.train
        return self._batches(data, GlobalBatchSampler(len(data), 0, shuffle=False), index, num_microbatches)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        # use_cache=False: a training step has no use for HF's KV cache, and a cache object threaded through the
        # blocks is one more thing for torch.compile to guard on; the loss is the same
        if fused_head(model) is not None:
            return fused_lm_loss(model, batch["labels"], input_ids=batch["tokens"], use_cache=False), {}
        return lm_loss(model(input_ids=batch["tokens"], use_cache=False).logits, batch["labels"]), {}

    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.cfg.train.seq_length

    def flops_per_token(self) -> float:
        return training_flops_per_token(self.cfg.model, self.cfg.train.seq_length)
