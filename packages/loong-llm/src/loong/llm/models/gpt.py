"""megatron-core's GPTModel with rotary embeddings taken from per-token position ids.

megatron-core 0.19.2 computes RoPE frequencies from the sequence length alone
(``RotaryEmbedding(seq_len)`` → ``[s, 1, 1, d]``, positions ``0..s-1`` for every sample); its
``position_ids`` argument only feeds learned absolute embeddings. Packed SFT needs positions that
restart at 0 for each document, so this subclass overrides ``_preprocess`` and, when position ids
are given during training, replaces the shared table by per-sample frequencies ``[s, b, 1, d]``.

``apply_rotary_pos_emb`` (unfused, bshd) computes ``t * cos(freqs) + rotate_half(t) * sin(freqs)``
on ``t`` of shape ``[s, b, heads, d]``, so ``[s, b, 1, d]`` broadcasts over the heads exactly as
``[s, 1, 1, d]`` broadcasts over batch and heads. With ``position_ids = arange(s)`` each
frequency is the same single fp32 product as megatron's ``torch.outer``, so the logits are
bit-identical to the stock model's.

With ``fused_kernels.cross_entropy`` the training / evaluation loss skips the ``[s, b, V]`` logits: the
output layer's GEMM and the cross-entropy run chunked in loong-kernels (:func:`~loong.llm.models.fused.fused_lm_loss`),
returning the same fp32 per-token losses ``[b, s]``. With multi-token prediction each MTP
layer's loss is fused the same way (megatron's ``process_mtp_loss`` would compute its logits). Everything else
(logits without labels, inference, packed sequences with MTP, a LoRA-wrapped or sequence-parallel output layer,
MuP scaling) takes megatron's path. ``precision.fp8_output_layer`` (:meth:`LoongGPTModel.enable_fp8_output_layer`)
runs the fused loss's logits and hidden-gradient GEMMs in FP8; it needs the fused loss, and the paths above that
leave it run in bf16.

Multi-token prediction under context parallelism always takes this module's MTP loss (fused or not): megatron's
``process_mtp_loss`` divides each CP rank's MTP loss by that rank's own token count, which differs between ranks
(the roll masks the sequence's last token on one of them), so its CP gradients are not one rank's. Here the count
is the whole sequences' (summed over the CP group), as the main loss's is.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear

from loong.core.engines.megatron.context_parallel import sum_over_cp
from loong.core.errors import LoongError
from loong.llm.models.fused import FusedKernels, fused_lm_loss


def rotary_freqs_from_positions(rope: Any, position_ids: torch.Tensor) -> torch.Tensor:
    """Rotary frequencies ``[s, b, 1, d]`` for ``position_ids`` ``[b, s]``.

    Uses ``rope.inv_freq`` as it stands (with llama3 scaling applied when configured), the
    interpolation factor and the (non-)interleaved layout of megatron's ``RotaryEmbedding.get_emb``.
    """
    inv_freq = rope.inv_freq.to(position_ids.device)
    pos = position_ids.t().to(inv_freq.dtype)  # [s, b]
    if rope.seq_len_interpolation_factor is not None:
        pos = pos * (1 / rope.seq_len_interpolation_factor)
    freqs = pos.unsqueeze(-1) * inv_freq  # [s, b, d/2], the same products as torch.outer
    if not rope.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    return emb.unsqueeze(2)  # [s, b, 1, d]


class LoongGPTModel(GPTModel):
    """GPTModel whose RoPE follows ``position_ids`` (e.g. restarting per packed document).

    Only the training / evaluation forward changes: with an inference context, packed THD
    sequences (``packed_seq_params``) or no position ids, megatron's own rotary table is used.
    ``fused_kernels`` (default: none) says whether the loss takes loong-kernels' fused linear+cross-entropy.
    """

    def __init__(self, *args: Any, fused_kernels: FusedKernels | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused_kernels = fused_kernels or FusedKernels()
        self.fp8_output_layer = False

    def enable_fp8_output_layer(self) -> bool:
        """``precision.fp8_output_layer``: the fused loss's logits and hidden-gradient GEMMs in FP8 (tensorwise;
        loong-kernels' ``fused_linear_cross_entropy(fp8=True)``). False on a chunk without the output layer (not
        the last pipeline stage); a :class:`LoongError` naming the reason where the fused loss cannot take it."""
        if not self.post_process:
            return False
        from loong.kernels.cross_entropy import fp8_unsupported

        fused, out = self.fused_kernels, self.output_layer
        reasons = []
        if not fused.cross_entropy:
            reasons.append("it needs the fused linear + cross-entropy, which this model does not take "
                           "(model.fused_kernels=off, tensor parallelism, or an accelerator without Triton)")
        elif fused.backend == "reference":
            reasons.append("the fused loss runs its plain-PyTorch reference here, which has no FP8 path")
        if type(out) is not ColumnParallelLinear or out.sequence_parallel:
            reasons.append(f"the output layer is a {type(out).__name__}"
                           f"{' (sequence parallel)' if out.sequence_parallel else ''}, not megatron's plain "
                           "ColumnParallelLinear")
        vocab, hidden = self._output_weight().shape
        why = fp8_unsupported(hidden, vocab)
        if why:
            reasons.append(why)
        if reasons:
            raise LoongError(f"precision.fp8_output_layer=true: {'; '.join(reasons)}. Set "
                             "precision.fp8_output_layer=false")
        self.fp8_output_layer = True
        return True

    def _preprocess(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        decoder_input: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple:
        out = super()._preprocess(
            input_ids=input_ids,
            position_ids=position_ids,
            decoder_input=decoder_input,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        rotary = out[1]
        if (
            rotary is None
            or position_ids is None
            or inference_context is not None
            or packed_seq_params is not None
            or self.position_embedding_type != "rope"
        ):
            return out
        # under context parallelism position_ids are already this rank's zigzag chunks (split with the tokens, as
        # megatron's get_batch_on_this_cp_rank does), so their table needs no CP slicing
        emb = rotary_freqs_from_positions(self.rotary_pos_emb, position_ids)
        if emb.shape[0] != rotary.shape[0]:
            raise ValueError(
                f"position_ids give {emb.shape[0]} rotary positions but the model expects {rotary.shape[0]}"
            )
        return (out[0], emb, *out[2:])

    def _fused_loss_applies(self, labels: torch.Tensor | None, kw: dict) -> bool:
        if not (self.fused_kernels.cross_entropy and self.post_process and labels is not None):
            return False
        if kw.get("output_processor") is not None:
            return False
        if self.config.mtp_num_layers and not self._fused_mtp_applies(kw):
            return False
        if kw.get("inference_context") is not None or kw.get("inference_params") is not None:
            return False
        if getattr(self.config, "use_mup", False):  # logits are scaled before the loss
            return False
        out = self.output_layer
        # exactly megatron's linear (not a LoRA subclass, whose adapters would be skipped), unsharded
        return (type(out) is ColumnParallelLinear and not out.sequence_parallel
                and self.config.tensor_model_parallel_size == 1 and not InferenceMode.is_active())

    def _fused_mtp_applies(self, kw: dict) -> bool:
        """Multi-token prediction in this chunk, on unpacked sequences (the case :meth:`_mtp_loss` handles;
        packed sequences roll their labels per document)."""
        return bool(kw.get("mtp_in_postprocess")) and kw.get("packed_seq_params") is None

    def _cp_size(self) -> int:
        cp = self.pg_collection.cp
        return 1 if cp is None else cp.size()

    def _cp_mtp_applies(self, labels: torch.Tensor | None, kw: dict) -> bool:
        """MTP losses of a training / evaluation forward under context parallelism without the fused loss: taken by
        :meth:`_mtp_loss` for the whole sequences' token count (see the module docstring)."""
        return (self._cp_size() > 1 and bool(self.config.mtp_num_layers) and self.post_process
                and labels is not None and self._fused_mtp_applies(kw) and kw.get("output_processor") is None
                and kw.get("inference_context") is None and kw.get("inference_params") is None
                and not self.config.use_mup and not InferenceMode.is_active())

    def _output_weight(self) -> torch.Tensor:
        return self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else self.output_layer.weight

    def _token_losses(self, hidden: torch.Tensor, labels: torch.Tensor, fused: bool, kw: dict,
                      detach_weight: bool = False) -> torch.Tensor:
        """Per-token losses ``[b, s]``: loong-kernels' fused linear + cross-entropy, or megatron's output layer and
        ``compute_language_model_loss`` (``detach_weight``: megatron's ``mtp_detach_heads``)."""
        weight = self._output_weight()
        if detach_weight:
            weight = weight.detach()
        if fused:
            return fused_lm_loss(hidden, weight, labels, self.fused_kernels.backend, fp8=self.fp8_output_layer)
        logits, _ = self.output_layer(hidden, weight=weight, runtime_gather_output=kw.get("runtime_gather_output"))
        return self.compute_language_model_loss(labels, self._scale_logits(logits))

    def _mtp_loss(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  labels: torch.Tensor, kw: dict, fused: bool) -> torch.Tensor:
        """megatron-core's MTP block, then its ``process_mtp_loss`` with each MTP layer's loss from
        :meth:`_token_losses` (``fused``: without the ``[s, b, V]`` logits): the same rolled labels and loss mask,
        the same ``MTPLossAutoScaler`` terms and the same logged loss, except that under context parallelism the
        token count is the whole sequences' and the term is scaled by the CP size (megatron's DDP averages gradients
        over DP x CP), as the main loss is. Returns the main model's hidden states.

        The acceptance counts megatron also logs need the logits this path avoids; they are recorded as 0 of 0
        (Loong logs ``mtp_loss`` only).
        """
        from megatron.core.transformer.multi_token_prediction import (
            MTPLossAutoScaler,
            MTPLossLoggingHelper,
            roll_tensor,
        )

        cfg = self.config
        hidden_states = self.mtp(
            input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
            attention_mask=kw.get("attention_mask"), inference_params=None,
            rotary_pos_emb=kw.get("rotary_pos_emb"), rotary_pos_cos=kw.get("rotary_pos_cos"),
            rotary_pos_sin=kw.get("rotary_pos_sin"), packed_seq_params=None,
            sequence_len_offset=kw.get("sequence_len_offset"), padding_mask=kw.get("padding_mask"),
            embedding=self.embedding, **(kw.get("extra_block_kwargs") or {}),
        )
        chunks = torch.chunk(hidden_states, 1 + cfg.mtp_num_layers, dim=0)
        main = chunks[0]
        mtp_labels = labels.clone()
        loss_mask = kw.get("loss_mask")
        if loss_mask is None:
            loss_mask = torch.ones_like(mtp_labels)
        cp = self.pg_collection.cp
        cp_size = self._cp_size()
        original_num_tokens = sum_over_cp(loss_mask.sum(), cp)
        zero = torch.zeros((), device=main.device)
        for layer in range(cfg.mtp_num_layers):
            mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=cp)
            loss_mask, num_tokens = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp)
            num_tokens = sum_over_cp(num_tokens, cp)
            mtp_loss = loss_mask * self._token_losses(chunks[layer + 1], mtp_labels, fused, kw, cfg.mtp_detach_heads)
            safe = num_tokens.clamp(min=1)
            if self.training:  # averaged over DP x CP by the helper: the CP ranks' shares sum to the mean
                logged = mtp_loss.sum() * (num_tokens > 0).to(mtp_loss.dtype) * cp_size / safe
                MTPLossLoggingHelper.save_metrics_to_tracker(
                    logged, zero, zero, layer, cfg.mtp_num_layers, avg_group=getattr(self.pg_collection, "dp_cp", None))
            scale = cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers
            if cfg.calculate_per_token_loss:  # finalize_model_grads divides by the main loss's token count
                main = MTPLossAutoScaler.apply(main, scale * mtp_loss * (original_num_tokens / safe))
            else:
                main = MTPLossAutoScaler.apply(main, scale * mtp_loss * cp_size / safe)
        return main

    def _postprocess(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     labels: torch.Tensor | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        fused = not args and self._fused_loss_applies(labels, kwargs)
        if not (fused or (not args and self._cp_mtp_applies(labels, kwargs))):
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        if self.config.mtp_num_layers:
            hidden_states = self._mtp_loss(hidden_states, input_ids, position_ids, labels, kwargs, fused)
        return self._token_losses(hidden_states, labels, fused, kwargs)
