"""The peer rows of ``llm_throughput.py``: Hugging Face transformers + Liger kernels, and torchtitan.

``hf_liger``: ``use_liger`` calls liger-kernel's own entry point for the preset's family
(``apply_liger_kernel_to_llama`` / ``apply_liger_kernel_to_qwen3``, liger-kernel 0.8.5, which requires
transformers >= 5.0) with ``rope``, ``rms_norm``, ``swiglu`` and ``fused_linear_cross_entropy`` on, before the
model is built, so transformers' modeling module builds Liger's RMSNorm and SwiGLU MLP and its
``ForCausalLM.forward`` is Liger's ``lce_forward``. The loss then comes out of the model's forward
(``model(input_ids=..., shift_labels=labels)``: our labels are already shifted, so they go in as
``shift_labels``; in training mode Liger's forward never materialises the logits and returns the mean
cross-entropy of its fused linear + cross-entropy kernel).

``torchtitan`` / ``torchtitan_compat``: torchtitan 0.3.0 (PyPI) builds its own model of the preset's shape
(``titan_model_config``: its ``Llama3Model`` for llama presets, ``Qwen3Model`` with q/k-norm for qwen3; the layer
configs come from torchtitan's own builders ``_build_llama3_layers`` / ``_build_qwen3_layers``, its initialisers,
FlexAttention, its default ``attn_backend``), applies its own parallelize function for one GPU with the settings
its ``Trainer.Config`` gives by default (selective per-op activation checkpointing, spmd_types backend, FSDP2 over
the one-rank mesh with bf16 parameters and fp32 reductions) plus ``compile.enable=True`` (each block compiled,
``fullgraph=True``, and the loss), and its ``ChunkedLossWrapper`` over ``CrossEntropyLoss`` (8 chunks, sum over
tokens divided by the step's token count; ``torchtitan_compat``: its plain ``CrossEntropyLoss``, the loss of its
``llama3_debugmodel_ce_loss`` config, see below), its gradient clipping, and CUDA graphs over the forward + backward as
its Trainer does by default (``training.disable_cuda_graphs=False``).

The loop is ours, not torchtitan's ``Trainer``: the Trainer reads its tokenizer from a Hugging Face folder and its
data through its own ``HuggingFaceTextDataLoader`` / ``datasets`` pipeline, and builds its own AdamW (weight decay
on every parameter) and learning-rate schedule. Feeding it loong-llm's token windows in loong-llm's seeded order,
with the AdamW parameter groups and warm-up + cosine schedule every other row uses, would mean replacing its data
loader, tokenizer, optimizer and scheduler, i.e. all of the Trainer but the few calls ``titan_worker`` makes in the
same order the Trainer's ``__init__`` and ``train_step`` make them (``update_from_config``, meta build,
``parallelize_fn``, ``to_empty`` + ``init_weights``, loss ``build`` + ``set_lm_head``, ``get_spmd_context``,
``get_attention_masks``, ``wrap_with_cuda_graph``, ``clip_grad_norm_``).

torchtitan 0.3.0 is built against a PyTorch nightly (its README: "each stable release pins the nightly versions of
torch and torchao"). On torch 2.11 its import stops at ``from torch.distributed.fsdp import DataParallelMeshDims``
(torch/distributed/fsdp/__init__.py has no such name). The ``torchtitan`` row runs it as is and keeps that error.
``torchtitan_compat`` first applies ``titan_compat``: stand-ins for what is missing from torch 2.11 on the dense
one-GPU path (each one listed in the row's JSON), and nothing else of torchtitan's code changes. Its loss is
torchtitan's unchunked ``CrossEntropyLoss`` (``--titan-loss chunked`` to try the default): on torch 2.11 (seen on
the CPU and on an H200, with and without CUDA graphs) the ``ChunkedLossWrapper``'s backward through FSDP2 fails. It reshards the ``[tok_embeddings, norm,
lm_head]`` (untied: ``[norm, lm_head]``) FSDP group after its chunks, and the backward through the final norm then
meets a freed parameter ("The tensor has a non-zero number of elements, but its data is not allocated yet");
without that reshard, FSDP's reduce-scatter meets mixed bf16/fp32 gradients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

TITAN_FLAVOR = {"llama": "1B", "qwen3": "1.7B"}  # torchtitan flavours whose builders the shapes are passed to


def use_liger(family: str) -> str:
    """Liger's kernels for the HF model of ``family`` (``llama`` / ``qwen3``), applied before the model is built:
    RoPE, RMSNorm (the q/k norms of Qwen3 too), SwiGLU MLP and the fused linear + cross-entropy forward. Returns the
    entry point's name."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen3

    entry = {"llama": apply_liger_kernel_to_llama, "qwen3": apply_liger_kernel_to_qwen3}.get(family)
    if entry is None:
        raise ValueError(f"no Liger row for model family {family!r} (llama, qwen3)")
    entry(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    return entry.__name__


def titan_compat() -> list[str]:
    """Make torchtitan 0.3.0 import and run its dense one-GPU path on a torch release older than the nightly it was
    built for; returns what was patched (empty where the torch already has it). Call before importing torchtitan.

    - ``torch.distributed.fsdp.DataParallelMeshDims`` (nightly): torchtitan imports it at module level; on the dense
      path it is only a type annotation and a ``None`` default (passed on to ``fully_shard`` only for the
      ``full_dtensor`` backend). Stand-in: an empty dataclass.
    - ``torch.distributed.fsdp._fully_shard._fsdp_common.ShardPlacementResult`` (nightly): imported inside
      ``apply_fsdp_to_decoder``'s MoE branch only. Stand-in: an empty dataclass.
    - ``create_block_mask(..., separate_full_blocks=True)`` (nightly keyword): torch 2.11's ``create_block_mask``
      always keeps full blocks apart, which is what ``True`` asks for; the keyword is dropped (``False`` raises).
    """
    import dataclasses

    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    done = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = dataclasses.make_dataclass("DataParallelMeshDims", [])
        done.append("torch.distributed.fsdp.DataParallelMeshDims: stand-in (type annotation on the dense path)")
    if not hasattr(_fsdp_common, "ShardPlacementResult"):
        _fsdp_common.ShardPlacementResult = dataclasses.make_dataclass("ShardPlacementResult", [])
        done.append("torch.distributed.fsdp._fully_shard._fsdp_common.ShardPlacementResult: stand-in (MoE only)")
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        import torchtitan.models.common.attention as attention

        compiled = attention._compiled_create_block_mask

        def create(*args: Any, separate_full_blocks: bool = True, **kwargs: Any) -> Any:
            if not separate_full_blocks:
                raise NotImplementedError("create_block_mask(separate_full_blocks=False) needs a newer torch")
            return compiled(*args, **kwargs)

        attention._compiled_create_block_mask = create
        done.append("create_block_mask(separate_full_blocks=True): keyword dropped (torch 2.11's behaviour)")
    return done


def titan_model_config(m: Any, seq: int) -> Any:
    """torchtitan's model config (``Llama3Model.Config`` / ``Qwen3Model.Config``) of loong-llm's model config ``m``,
    assembled as torchtitan's own flavours (``_1b``/``_8b`` of llama3, ``_1_7b`` of qwen3) assemble theirs, with
    ``m``'s widths, depth, heads, vocabulary, RoPE (theta; llama3 scaling where ``m`` has it) and tying."""
    from torchtitan.models.common import Embedding, Linear

    tied = m.tie_word_embeddings
    if m.family == "llama":
        from torchtitan.models import llama3 as t
        from torchtitan.models.common import ComplexRoPE, RMSNorm

        if m.kv_channels * m.num_attention_heads != m.hidden_size:
            raise ValueError("torchtitan's llama3 ties head_dim to hidden/heads")
        rs = m.rope_scaling
        rope = ComplexRoPE.Config(dim=m.kv_channels, max_seq_len=max(seq, m.max_position_embeddings),
                                  theta=m.rope_theta,
                                  **(dict(scaling="llama", scaling_factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                                          high_freq_factor=rs.high_freq_factor,
                                          original_max_position_embeddings=rs.original_max_position_embeddings)
                                     if rs else dict(scaling="none")))
        layers = t._build_llama3_layers(fuse_qkv=True, n_layers=m.num_layers, dim=m.hidden_size,
                                        n_heads=m.num_attention_heads, n_kv_heads=m.num_query_groups,
                                        hidden_dim=m.ffn_hidden_size, rope=rope, attn_backend="flex")
        return t.Llama3Model.Config(
            dim=m.hidden_size, vocab_size=m.vocab_size, enable_weight_tying=tied,
            tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=m.hidden_size,
                                            param_init=t._EMBEDDING_SKIP_INIT if tied else t._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=m.hidden_size, eps=m.norm_eps, param_init=t._NORM_INIT),
            lm_head=Linear.Config(in_features=m.hidden_size, out_features=m.vocab_size,
                                  param_init=t._output_linear_init(m.hidden_size)),
            layers=layers)
    if m.family == "qwen3":
        from torchtitan.models import qwen3 as t
        from torchtitan.models.common import CosSinRoPE

        if not m.qk_norm or m.rope_scaling is not None:
            raise ValueError("torchtitan's dense qwen3 has q/k norms and plain RoPE")
        layers = t._build_qwen3_layers(fuse_qkv=True, n_layers=m.num_layers, dim=m.hidden_size,
                                       n_heads=m.num_attention_heads, n_kv_heads=m.num_query_groups,
                                       head_dim=m.kv_channels, hidden_dim=m.ffn_hidden_size, attn_backend="flex",
                                       rope=CosSinRoPE.Config(dim=m.kv_channels, theta=m.rope_theta,
                                                              max_seq_len=max(seq, m.max_position_embeddings)))
        return t.Qwen3Model.Config(
            vocab_size=m.vocab_size, dim=m.hidden_size, norm=t._qwen3_norm(m.hidden_size), enable_weight_tying=tied,
            tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=m.hidden_size,
                                            param_init=t._EMBEDDING_SKIP_INIT if tied else t._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=m.hidden_size, out_features=m.vocab_size, param_init=t._LINEAR_INIT),
            layers=layers)
    raise ValueError(f"no torchtitan row for model family {m.family!r} (llama, qwen3)")


def _cpu_attention() -> None:
    """CPU smoke only: torch's FlexAttention has no CPU backward, so its call becomes SDPA with a causal mask (the
    same attention for the one document per window every row trains on). Never used on a GPU."""
    import torch.nn.functional as F
    from torchtitan.models.common.attention import FlexAttention

    def sdpa(q: Any, k: Any, v: Any, *, scale: Any = None, enable_gqa: bool = False, return_aux: Any = None,
             **_: Any) -> tuple[Any, None]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa), None

    FlexAttention._compiled_flex_attn = staticmethod(sdpa)


def titan_worker(args: argparse.Namespace) -> None:
    """torchtitan's model, parallelize, loss and clipping on loong-llm's data in loong-llm's order with the rows'
    AdamW and schedule (module docstring); prints one JSON line."""
    import os

    patched = titan_compat() if args.titan_compat else []
    import torch
    import torch.distributed as dist
    from llm_throughput import (
        PEAK_BF16,
        TITAN_GRAPHS,
        _loss_summary,
        _lr,
        corpus_windows,
        llm_config,
        microbatch,
    )

    from loong.llm.models.config import training_flops_per_token

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", device_id=device if gpu else None)

    import torchtitan
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
    from torchtitan.models import llama3, qwen3
    from torchtitan.trainer import Trainer

    cfg = llm_config(args.preset, args.seed, args.num_layers)
    m = cfg.model
    if not gpu:
        parallel_dims_module.device_type = "cpu"  # torchtitan takes "cuda" when no accelerator is found
        _cpu_attention()
    registry = {"llama": llama3, "qwen3": qwen3}[m.family]
    spec = registry.model_registry(TITAN_FLAVOR[m.family])
    spec.model = titan_model_config(m, args.seq)
    graphs = gpu and not args.titan_no_cuda_graphs
    chunked = (args.titan_loss or ("ce" if args.titan_compat else "chunked")) == "chunked"
    ce = CrossEntropyLoss.Config(global_vocab_size=m.vocab_size)
    tc = Trainer.Config(model_spec=spec, compile=CompileConfig(enable=gpu and not args.titan_no_compile),
                        training=TrainingConfig(local_batch_size=args.mbs, global_batch_size=args.gbs, seq_len=args.seq,
                                                steps=args.steps, disable_cuda_graphs=not graphs),
                        loss=ChunkedLossWrapper.Config(loss_fn=ce) if chunked else ce)
    dist_utils.set_spmd_backend(tc.parallelism.spmd_backend)
    spec.model.update_from_config(config=tc)
    pdims = ParallelDims.from_config(tc.parallelism, 1)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=pdims, training=tc.training, parallelism=tc.parallelism,
                                compile_config=tc.compile, ac_config=tc.activation_checkpoint,
                                dump_folder=args.titan_dump)
    model.to_empty(device=device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = tc.loss.build(compile_config=tc.compile)
    if chunked:  # as the Trainer does for a ChunkedLossWrapper: the loss applies lm_head chunk by chunk
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    context = dist_utils.get_spmd_context(parallel_dims=pdims, spmd_typechecking=False)

    def fwd_bwd(inputs: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor, extra: dict) -> torch.Tensor:
        with context():  # the Trainer's _forward_backward_body
            loss, _ = loss_fn(model(inputs, **extra), labels, tokens)
            loss.backward()
        return loss

    step_fn = wrap_with_cuda_graph(fwd_bwd) if graphs else fwd_bwd
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]  # as every row: no decay on norms
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=gpu)
    train, _, sampler = corpus_windows(cfg.data, args.data_path, args.seq, cfg.train.seed)
    accum = args.gbs // args.mbs
    n_tokens = torch.tensor(args.gbs * args.seq, device=device)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    tps, losses = [], []
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    # Every window is one causal sequence (positions 0..seq-1), so the Trainer's per-step get_attention_masks gives
    # the same BlockMask each time: built once (one mask_mod object, which CUDA-graph replay compares) and reused.
    pos = microbatch(train, sampler, 0, args.mbs)["position_ids"].to(device)
    extra = {"positions": pos, "attention_masks": model.get_attention_masks(positions=pos)}
    if graphs:
        print(TITAN_GRAPHS, flush=True)
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, args)
        opt.zero_grad(set_to_none=not graphs)  # the Trainer keeps the gradients' storage under CUDA graphs
        sync()
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for i in range(accum):
            mb = microbatch(train, sampler, step * args.gbs + i * args.mbs, args.mbs)
            ids, labels = mb["tokens"].to(device), mb["labels"].to(device)
            total += step_fn(ids, labels, n_tokens, extra).detach()  # sum / step tokens: adds up to the mean
        dist_utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        losses.append(float(total))
        tps.append(args.gbs * args.seq / (time.perf_counter() - t0))
    tok_s = statistics.median(tps[args.warmup:])
    mfu = tok_s * training_flops_per_token(m, args.seq) / PEAK_BF16 if gpu else None
    mem = round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None
    print(json.dumps({"tokens_per_s": round(tok_s, 1), "mfu": None if mfu is None else round(mfu, 4),
                      "peak_memory_gib": mem, "torchtitan": getattr(torchtitan, "__version__", None),
                      "titan_settings": {"compile": tc.compile.enable, "activation_checkpoint":
                                         type(tc.activation_checkpoint).__qualname__, "cuda_graphs": graphs,
                                         "spmd_backend": tc.parallelism.spmd_backend, "attention": "flex",
                                         "loss": "ChunkedLossWrapper(CrossEntropyLoss, 8 chunks)" if chunked
                                         else "CrossEntropyLoss (lm_head in the model's forward)"},
                      "torch_compat_patches": patched, **_loss_summary(losses)}))
    dist.destroy_process_group()
