"""The ``sft`` task (alias ``llm.sft``): supervised fine-tuning on chat data.

Reads a chat JSONL file (:mod:`.formats`), renders and tokenises each conversation with a chat
template (:mod:`.templates`), packs them into sequences with per-document attention (:mod:`.packing`)
and trains on the assistant tokens only. The loss is a per-token mean over the whole global batch
(megatron-core's ``calculate_per_token_loss``): every assistant token weighs the same however the
conversations fall into sequences and micro-batches.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from loong.core.errors import LoongError
from loong.core.registry import TASKS
from loong.llm.data.text import GlobalBatchSampler
from loong.llm.data.tokenizer import load_tokenizer
from loong.llm.pretrain import PretrainTask
from loong.llm.sft.formats import ChatFormatError, Conversation, ReadStats, read_conversations
from loong.llm.sft.packing import PackedSequences, fit_documents, make_sft_microbatch
from loong.llm.sft.templates import ChatTemplate, check_template_name, encode_conversation, resolve_template


def packaged_chat_path() -> Path:
    """The small chat example shipped with loong-llm (used when ``data.path`` is null)."""
    return Path(str(resources.files("loong.llm") / "assets" / "chat_example.jsonl"))


def encode_all(conversations: list[Conversation], hf: Any, template: ChatTemplate, path: Path,
               on_error: str, stats: ReadStats) -> list[tuple[list[int], list[int]]]:
    """Tokenise every conversation; template failures raise with ``file:line`` or are skipped."""
    encoded = []
    for conv in conversations:
        try:
            encoded.append(encode_conversation(hf, template, conv.messages))
        except ChatFormatError as exc:
            if on_error != "skip":
                raise LoongError(f"{path}:{conv.line}: {exc} (data.on_error=skip skips such lines)") from None
            stats.skipped[exc.kind] += 1
    return encoded


@TASKS.register("llm.sft")
class SFTTask(PretrainTask):
    """Supervised fine-tuning of a dense decoder on conversations (assistant-only loss)."""

    balances_data = True

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        super().check_config(cfg)
        if cfg.data.balance.enabled and cfg.parallel.pp > 1:
            raise LoongError("data.balance.enabled=true plans micro-batches of varying shape, which the "
                             f"pipeline schedule does not take (parallel.pp={cfg.parallel.pp}); use pp=1")
        if cfg.data.paths:
            raise LoongError("data.paths (a blend of preprocessed corpora) is for pretraining; "
                             "SFT reads one chat .jsonl file from data.path")
        if cfg.parallel.cp > 1:
            raise LoongError(f"parallel.cp={cfg.parallel.cp}: SFT does not support context parallelism yet")
        check_template_name(cfg.data.chat_template)

    def model_config(self, dtype: torch.dtype) -> Any:
        if self.cfg.data.packing and "transformer_engine" in self.accelerator.capabilities():
            raise LoongError(
                "data.packing=true needs the document attention mask, which Transformer Engine's causal "
                "attention ignores; set data.packing=false (padded, one conversation per sequence)"
            )
        config = super().model_config(dtype)
        config.calculate_per_token_loss = True  # gradients / all assistant tokens of the global batch
        return config

    # --- data ------------------------------------------------------------------------------
    def setup_data(self) -> None:
        d, t = self.cfg.data, self.cfg.train
        self.tokenizer = load_tokenizer(d.tokenizer)
        if self.tokenizer.vocab_size > self.cfg.model.vocab_size:
            raise LoongError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size "
                             f"is {self.cfg.model.vocab_size}")
        path = Path(d.path) if d.path is not None else packaged_chat_path()
        conversations, self.read_stats = read_conversations(path, d.chat_format, d.on_error)
        hf = self.tokenizer.hf
        self.template = resolve_template(d.chat_template, hf)
        if self.template.name != "tokenizer":
            hf.chat_template = self.template.source  # the saved tokenizer / HF export carries it
        encoded = encode_all(conversations, hf, self.template, path, d.on_error, self.read_stats)
        n_valid = int(len(encoded) * d.valid_fraction) if len(encoded) > 1 else 0
        if d.valid_fraction > 0 and len(encoded) > 1:
            n_valid = max(1, n_valid)
        train_docs, self.fit_stats = fit_documents(encoded[: len(encoded) - n_valid], t.seq_length, d.overlong)
        valid_docs, valid_fit = fit_documents(encoded[len(encoded) - n_valid :], t.seq_length, d.overlong)
        for k in ("truncated", "dropped"):
            setattr(self.fit_stats, k, getattr(self.fit_stats, k) + getattr(valid_fit, k))
        if not train_docs:
            raise LoongError(f"data.path: {path}: no conversation is left to train on "
                             f"({self.fit_stats.dropped} dropped at train.seq_length={t.seq_length})")
        self.train_data = PackedSequences(train_docs, t.seq_length, d.packing, self.tokenizer.eod_id)
        self.valid_data = PackedSequences(valid_docs, t.seq_length, d.packing, self.tokenizer.eod_id)
        self.sampler = GlobalBatchSampler(len(self.train_data), t.seed)
        self.device = self.accelerator.device(self.layout.local_rank)
        self.balanced = None
        if d.balance.enabled:
            from loong.llm.sft.balance import BalancedConversations

            self.balanced = BalancedConversations(self.cfg, self.train_data, self.sampler, self.layout.dp,
                                                  self.layout.pg_collection.dp)
        if self.layout.is_logging_rank:
            print(self.summary(path), file=sys.stderr)

    def summary(self, path: Path) -> str:
        """One line on what the data became: conversations, truncation, skips, packing efficiency."""
        r, f, tr = self.read_stats, self.fit_stats, self.train_data
        skipped = r.skipped_lines
        reasons = f" ({', '.join(f'{k}: {v}' for k, v in sorted(r.skipped.items()))})" if skipped else ""
        formats = ", ".join(f"{k} {v}" for k, v in sorted(r.formats.items()))
        layout = "packed" if self.cfg.data.packing else "one per sequence"
        return (f"sft data: {path.name}: {len(tr.docs) + len(self.valid_data.docs)} conversations used "
                f"({len(tr.docs)} train, {len(self.valid_data.docs)} valid; {formats}), {f.truncated} truncated, "
                f"{f.dropped} dropped, {skipped} skipped lines{reasons}; template {self.template.name}; "
                f"{len(tr)} sequences of {tr.seq_length} ({layout}), packing efficiency {tr.efficiency:.1%}")

    def _loss_tokens(self, data: PackedSequences, indices: list[int]) -> int:
        return int(sum(data.loss_tokens[i] for i in indices))

    def _sft_batches(self, data: PackedSequences, global_indices: list[int], first_local: int,
                     nmb: int) -> Iterator[dict]:
        """This rank's micro-batches; the reported loss is scaled so that the engine's mean over
        micro-batches and data-parallel ranks is the global batch's per-token mean."""
        scale = nmb * self.layout.dp / max(1, self._loss_tokens(data, global_indices))
        mbs = self.cfg.train.micro_batch_size
        for m in range(nmb):
            picked = global_indices[first_local + m * mbs : first_local + (m + 1) * mbs]
            batch = make_sft_microbatch([data[i] for i in picked])
            batch["loss_scale"] = torch.tensor(scale, dtype=torch.float32)
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _balanced_batches(self, step: int, nmb: int) -> Iterator[dict]:
        assert self.balanced is not None
        scale = nmb * self.layout.dp / max(1, self.balanced.loss_tokens(step))
        for rows in self.balanced.rows(step, self.layout.dp_rank):
            batch = make_sft_microbatch(self.balanced.row_arrays(rows))
            batch["loss_scale"] = torch.tensor(scale, dtype=torch.float32)
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    # --- data-parallel balancing (core hooks) -----------------------------------------------
    def num_train_microbatches(self, step: int, default: int) -> int:
        return self.balanced.plan(step)[0].num_micro_batches if self.balanced else default

    def measures_compute_time(self) -> bool:
        return bool(self.balanced and self.balanced.balancer.measures_time)

    def after_train_step(self, step: int, extra: dict[str, float]) -> dict[str, float]:
        metrics = super().after_train_step(step, extra)  # e.g. the MoE load-balancing loss
        if not self.balanced:
            return metrics
        metrics.update(self.balanced.step_metrics(step))
        if "compute_s" in extra:
            fitted = self.balanced.balancer.observe(self.balanced.plan(step)[0], extra["compute_s"], self.device)
            if fitted and self.layout.is_logging_rank:
                print(f"data.balance: fitted cost = {fitted['balance_cost_a']:.3g}*len^2 + "
                      f"{fitted['balance_cost_b']:.3g}*len + {fitted['balance_cost_c']:.3g} seconds", file=sys.stderr)
            metrics.update(fitted)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"balance": self.balanced.balancer.state_dict()} if self.balanced else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.balanced:
            self.balanced.balancer.load_state_dict(state.get("balance", {}))

    def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict]:
        if self.balanced:
            return self._balanced_batches(step, num_microbatches)
        gbs = self.cfg.train.global_batch_size
        indices = [self.sampler.index(g) for g in range(step * gbs, (step + 1) * gbs)]
        return self._sft_batches(self.train_data, indices, self._rank_offset(num_microbatches), num_microbatches)

    def eval_microbatches(self, index: int, num_microbatches: int) -> Iterator[dict]:
        data = self.valid_data if len(self.valid_data) else self.train_data
        gbs = self.cfg.train.global_batch_size
        indices = [g % len(data) for g in range(index * gbs, (index + 1) * gbs)]
        return self._sft_batches(data, indices, self._rank_offset(num_microbatches), num_microbatches)

    # --- loss ------------------------------------------------------------------------------
    @staticmethod
    def _loss(loss_mask: torch.Tensor, output: torch.Tensor, loss_scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(sum of assistant-token losses, their count, the loss to report) for megatron's schedule."""
        loss_sum = (output.float() * loss_mask).sum()
        num_tokens = loss_mask.sum().to(torch.int)
        report = loss_sum.detach() * (loss_scale if loss_scale is not None else 1 / num_tokens.clamp(min=1))
        return loss_sum, num_tokens, {"loss": report.clone()}

    def forward_step(self, data_iterator: Iterator[dict], model: torch.nn.Module) -> tuple[Any, Any]:
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return output, partial(self._loss, batch["loss_mask"], loss_scale=batch["loss_scale"])

