"""VLM training throughput on one GPU: Hugging Face transformers (eager, + Liger kernels) on Qwen-VL shapes.

Every row trains the same model shape from random weights on the same synthetic image–text samples in the same
order, each row in its own process (clean memory statistics). The models (``--preset published``, the default;
``--models`` picks families):

- ``qwen2_5_vl_3b``: the published Qwen2.5-VL-3B shape (text: 36 layers, hidden 2048, FFN 11008, 16/2 heads, tied
  151,936 vocab; ViT: 32 layers, hidden 1280, window 112 px with full attention at 7/15/23/31; 3.75B parameters);
- ``qwen3_vl_2b``: the published Qwen3-VL-2B shape (text: 28 layers, hidden 2048, FFN 6144, 16/8 heads of 128,
  tied vocab, interleaved M-RoPE; ViT: 24 layers, hidden 1024, patch 16, DeepStack at 5/11/17; 2.13B parameters).
  Qwen3-VL-4B (4.4B parameters, hidden 2560) is left out: scaled from the 3B row's measured 125.8 GiB, HF eager
  would need about 150 GiB at this batch, more than one H200 has.

``--preset tiny`` swaps in two-layer models of the same families, 224² images and 256-token samples (the CPU
smoke run: about 30 s of CPU time; without CUDA the rows run in fp32, no autocast, and report no MFU or memory).

The data (:func:`sample`, deterministic in ``(--seed, sample index)``; sample ``g`` of step ``s`` is
``s·gbs + g``): one ``--image-size``² RGB image per sample (uint8 noise put through the Qwen image processor's
arithmetic without the processor: rescale by 1/255, normalise with the family's mean/std, the frame repeated to
the temporal patch, patches flattened in the processor's merge-unit order), so 448² gives 1,024 patches / 256
image tokens (Qwen2.5-VL, patch 14) or 784 / 196 (Qwen3-VL, patch 16); the text is ``--seq`` tokens: 16 random
text tokens, ``<|vision_start|>``, the ``<|image_pad|>`` tokens, ``<|vision_end|>``, random text tokens to the end
(drawn below the special ids, so the loss stays near ln 151,643 ≈ 11.93: a cross-row check, not a learning
curve). ``mm_token_type_ids`` marks the image tokens (transformers then builds the M-RoPE ids); the labels are
the text tokens (the vision markers and image tokens are -100). ``--mbs`` samples a micro-batch, gradient
accumulation to ``--gbs``.

Rows (:data:`ROWS`):

- ``hf_eager``: ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration`` from the config,
  ``attn_implementation="sdpa"``, fp32 weights under bf16 autocast (what ``Trainer(bf16=True)`` does with a
  model built or loaded in its default fp32: the optimiser steps fp32 master weights, matmuls run in bf16),
  ``labels`` passed to the model (its own shifted cross-entropy over fp32 logits), fused AdamW at a constant
  ``--lr`` with the Trainer's other defaults (betas 0.9/0.999, no weight decay, gradient clipping at 1.0).
- ``hf_liger``: the same with Liger's kernels (liger-kernel 0.8.5) set where transformers calls them, the set
  ``apply_liger_kernel_to_qwen2_5_vl()`` / ``apply_liger_kernel_to_qwen3_vl()`` enable by default: RMSNorm
  (Qwen2.5-VL: text and ViT; Qwen3-VL: text, q/k norms included), SwiGLU (Qwen2.5-VL's text MLP only; the Qwen3-VL
  default leaves it off), RoPE (Qwen3-VL: text and ViT), and the fused linear cross-entropy (logits never
  materialised). The entry points themselves cannot run on the workspace's transformers 5.24: they import
  model-specific output classes (``Qwen2_5_VLCausalLMOutputWithPast``, ``Qwen3VLCausalLMOutputWithPast``) that
  transformers replaced by ``MultimodalCausalLMOutputWithPast`` (ImportError before anything is patched), their fused-loss forward reads
  output fields that no longer exist (``past_key_values``, ``rope_deltas``), and the Qwen2.5-VL M-RoPE patch
  targets ``apply_multimodal_rotary_pos_emb``, which 5.24 no longer calls (it folds the M-RoPE sections into
  cos/sin and calls ``apply_rotary_pos_emb``; Liger's plain RoPE kernel is what applies there). So this row
  swaps the module classes and functions in transformers' modeling module before building the model (what the
  entry points do with ``model=None``) and computes the loss with ``LigerForCausalLMLoss``, the function their
  fused-loss forward calls. Each row's JSON says whether the entry point imports (``liger_entry_point``).
  Liger's kernels are Triton GPU kernels with no CPU implementation (and Triton's CPU interpreter rejects its
  RMSNorm kernel), so on a machine without CUDA this row reports itself skipped.

- ``loong_bf16``: ``loong-vlm train`` of the same shape (megatron engine, bf16, loong-kernels' fused kernels);
  ``loong_selective`` adds ``foundation.recompute=selective``; ``loong_lean`` that, ``encoder.recompute=true`` and
  ``train.grad_reduce_in_bf16=true`` (bf16 gradient buffers: 2 bytes a parameter less; "lean" in the table); ``loong_fp8`` /
  ``loong_fp8_lean``: ``precision.fp8=tensorwise`` (the foundation's megatron linears; the ViT's and projector's
  ``nn.Linear`` stay bf16) without / with the lean settings.
- ``loong_packed``: dynamic resolution and packing: each sample's image side in turn from ``--packed-sizes``
  (224/448/672: 64/256/576 Qwen2.5-VL image tokens), its answer 16 words to half a sequence, several samples
  packed into each ``--seq`` sequence (varlen attention per sample, M-RoPE restarting); its tokens/s counts the
  real tokens (``gbs·seq`` times the packing efficiency the run's data summary prints); no MFU or patches/s
  (the images of a step vary).

Columns (medians over the steps after ``--warmup``; a step's wall time ends with the loss's host sync):
seconds per step, tokens/s (``gbs·seq``: text and image tokens), ViT patches/s, MFU, peak device memory
(``torch.cuda.max_memory_allocated``), the loss at the last step, and tokens/s and memory against ``hf_eager``
of the same model. MFU = step FLOPs / step time / 989 TFLOP/s (an H200's dense bf16 peak), with the training
FLOPs of a step counted analytically (:func:`training_flops`; ×3 of the forward, recomputation not counted)::

    LLM, per sequence of S tokens:  6·N_llm·S + 12·L·(H·d_h)·S²
    ViT, per image of P patches:    6·N_patch·P + 6·N_merge·P/m² + 12·d_vit·Σ_layers pairs_l

``N_llm``: the text model's weights less the input embedding, plus the LM head (counted once when tied);
``N_patch``: the ViT's patch embedding and blocks (its position-embedding table left out); ``N_merge``: the patch
merger(s) (Qwen3-VL: DeepStack mergers too), applied to the ``P/m²`` merged tokens (m = spatial merge size);
``pairs_l`` = P² for a full-attention layer (per frame), Σ_windows n_w² for a window layer (Qwen2.5-VL:
windows of 112 px, 64 patches at patch 14). The attention terms count the whole score matrix (PaLM appendix B,
as ``loong.llm.models.config.training_flops_per_token`` does), so figures compare with the LLM benchmarks.
The parameter counts come from the HF model built on the meta device (:func:`model_counts`).

    python benchmarks/vlm_throughput.py                                  # all rows, both models (H200: ~5 min)
    python benchmarks/vlm_throughput.py --models qwen2_5_vl --rows hf_eager
    python benchmarks/vlm_throughput.py --preset tiny                    # CPU smoke (liger rows skip themselves)
    python benchmarks/vlm_throughput.py --rows loong_bf16 \
        --merge benchmarks/results/vlm_throughput_h200_published_<date>.json

Prints a table and writes JSON (commands, versions, hardware, settings, figures, loss curves) to
``benchmarks/results/vlm_throughput_<gpu>_<preset>_<date>.json``. ``--merge`` adds this run's rows to an
earlier result file of the same settings, so rows measured in several sessions land in one table.

Adding a row (e.g. Loong's): write ``def _my_row(shape: Shape, args, tmp: Path) -> dict`` that trains
``shape`` (``shape.name`` is loong-vlm's preset name of the same shape; ``args.seq``, ``args.mbs``,
``args.gbs``, ``args.steps``, ``args.lr``, ``args.seed``, ``args.image_size``) on the same samples
(:func:`sample` / :func:`microbatch` give the tensors, HF layout), and returns :func:`figures` of its per-step
wall times, losses and peak memory; then add the entry ``"my_row": Row("label", _my_row)`` to :data:`ROWS`
(``cpu="why"`` if it cannot run without CUDA). It runs in its own process; a row that starts another program
(``loong-vlm train ...``) uses ``_env.run_child`` and reads that run's per-step records. For instance::

    def _loong_bf16(shape: Shape, args: argparse.Namespace, tmp: Path) -> dict:
        cmd = ["loong-vlm", "train", f"model={shape.name}", f"train.seq_length={args.seq}",
               f"train.micro_batch_size={args.mbs}", f"train.global_batch_size={args.gbs}",
               f"train.steps={args.steps}", f"train.lr={args.lr}", f"train.seed={args.seed}",
               f"output_dir={tmp}", "run_name=loong_bf16", "train.log_interval=1", ...]  # + its data options
        proc = run_child(cmd)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        recs = [json.loads(x) for x in (tmp / "loong_bf16" / "metrics.jsonl").read_text().splitlines()]
        recs = [r for r in recs if "train_loss" in r]
        times = [b["time"] - a["time"] for a, b in zip(recs, recs[1:])]  # step i+1's wall time
        return figures(shape, args, times, [r["train_loss"] for r in recs[1:]],
                       max(r.get("peak_memory_gib", 0.0) for r in recs) or None)

    # in ROWS:  "loong_bf16": Row("Loong bf16", _loong_bf16),
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from _env import host, run_child, versions  # benchmarks/_env.py (run as scripts from the repo root)

if TYPE_CHECKING:  # the parent process imports neither torch nor transformers: each row's child does
    import torch

RESULTS = Path(__file__).parent / "results"
PEAK_BF16 = 989e12  # H200/H100 SXM dense bf16, the denominator MFU figures in this field use
PREFIX_TOKENS = 16  # text tokens before the image in every sample
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Shape:
    """One model shape: the HF composite config's parts, and the image processor's normalisation."""

    name: str  # loong-vlm's preset name of the same shape
    family: str  # "qwen2_5_vl" | "qwen3_vl"
    text: dict
    vision: dict
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    text_vocab: int = 151643  # random text tokens are drawn below this id (Qwen's first special token)
    tokens: dict = field(default_factory=lambda: {"image_token_id": 151655, "video_token_id": 151656,
                                                  "vision_start_token_id": 151652, "vision_end_token_id": 151653})

    def grid(self, image_size: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patches of one square image of ``image_size`` pixels."""
        side = self.vision["patch_size"] * self.vision["spatial_merge_size"]
        if image_size % side:
            raise SystemExit(f"--image-size {image_size}: {self.name} needs a multiple of {side} "
                             f"(patch {self.vision['patch_size']} x merge {self.vision['spatial_merge_size']})")
        n = image_size // self.vision["patch_size"]
        return (1, n, n)

    def image_tokens(self, image_size: int) -> int:
        t, h, w = self.grid(image_size)
        return t * h * w // self.vision["spatial_merge_size"] ** 2


_QWEN_IDS = {"bos_token_id": 151643, "eos_token_id": 151645}
_TINY_IDS = {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253}
_TINY_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
SHAPES: dict[str, dict[str, Shape]] = {
    "published": {
        "qwen2_5_vl": Shape(
            "qwen2_5_vl_3b", "qwen2_5_vl",
            text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                      num_attention_heads=16, num_key_value_heads=2, rms_norm_eps=1e-6, hidden_act="silu",
                      max_position_embeddings=128000, tie_word_embeddings=True, **_QWEN_IDS,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
            vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
                        hidden_act="silu", patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                        window_size=112, fullatt_block_indexes=[7, 15, 23, 31], out_hidden_size=2048,
                        tokens_per_second=2),
            mean=CLIP_MEAN, std=CLIP_STD),
        "qwen3_vl": Shape(
            "qwen3_vl_2b", "qwen3_vl",
            text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      hidden_act="silu", max_position_embeddings=262144, tie_word_embeddings=True, **_QWEN_IDS,
                      rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                       "mrope_interleaved": True}),
            vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3,
                        hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                        num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17], out_hidden_size=2048),
            mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
    },
    "tiny": {
        "qwen2_5_vl": Shape(
            "qwen2_5_vl_tiny", "qwen2_5_vl",
            text=dict(_TINY_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                   "mrope_section": [2, 3, 3]}),
            vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, hidden_act="silu",
                        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                        fullatt_block_indexes=[1], out_hidden_size=64, tokens_per_second=2),
            mean=CLIP_MEAN, std=CLIP_STD, text_vocab=250, tokens=_TINY_IDS),
        "qwen3_vl": Shape(
            "qwen3_vl_tiny", "qwen3_vl",
            text=dict(_TINY_TEXT, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                                "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
            vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                        hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                        num_position_embeddings=64, deepstack_visual_indexes=[0], out_hidden_size=64),
            mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), text_vocab=250, tokens=_TINY_IDS),
    },
}
PRESET_DEFAULTS = {"published": {"seq": 4096, "image_size": 448, "steps": 14, "warmup": 4,
                                  "packed_sizes": [224, 448, 672]},
                   "tiny": {"seq": 256, "image_size": 224, "steps": 3, "warmup": 1, "packed_sizes": [112, 224]}}
SETTINGS = ("preset", "seq", "mbs", "gbs", "steps", "warmup", "image_size", "lr", "seed", "packed_sizes")


# ---------------------------------------------------------------------------------------------------- data


def patchify(image: torch.Tensor, shape: Shape) -> torch.Tensor:
    """A ``[3, H, W]`` uint8 image as the Qwen image processor's ``pixel_values`` ``[t·h·w, C·T·p·p]``: rescaled,
    normalised, the frame repeated to the temporal patch, patches in merge-unit order (t, h/m, w/m, m, m)."""
    import torch

    v = shape.vision
    p, tp, m = v["patch_size"], v["temporal_patch_size"], v["spatial_merge_size"]
    c, height, width = image.shape
    x = image.float() / 255.0
    x = (x - torch.tensor(shape.mean).view(3, 1, 1)) / torch.tensor(shape.std).view(3, 1, 1)
    x = x.unsqueeze(0).expand(tp, c, height, width)  # one frame, repeated to the temporal patch
    gh, gw = height // p, width // p
    x = x.reshape(1, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h/m, w/m, m, m, C, T, p, p
    return x.reshape(gh * gw, c * tp * p * p).contiguous()


def sample(shape: Shape, seq: int, image_size: int, index: int, seed: int) -> dict[str, torch.Tensor]:
    """Sample ``index`` of the run: ``input_ids``/``labels``/``mm_token_type_ids`` ``[seq]``, ``pixel_values``
    ``[P, C·T·p·p]`` and ``image_grid_thw`` ``[1, 3]`` (the module docstring's layout)."""
    import torch

    n_img = shape.image_tokens(image_size)
    if PREFIX_TOKENS + n_img + 2 > seq:
        raise SystemExit(f"--seq {seq} is too short for {n_img} image tokens of a {image_size}² image "
                         f"plus {PREFIX_TOKENS + 2} text tokens")
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    image = torch.randint(0, 256, (3, image_size, image_size), generator=g, dtype=torch.uint8)
    ids = torch.randint(0, shape.text_vocab, (seq,), generator=g)
    tok = shape.tokens
    start, end = PREFIX_TOKENS, PREFIX_TOKENS + n_img + 1
    ids[start] = tok["vision_start_token_id"]
    ids[start + 1:end] = tok["image_token_id"]
    ids[end] = tok["vision_end_token_id"]
    labels = ids.clone()
    labels[start:end + 1] = -100
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == tok["image_token_id"]).int(),
            "pixel_values": patchify(image, shape), "image_grid_thw": torch.tensor([shape.grid(image_size)])}


def microbatch(shape: Shape, args: argparse.Namespace, first: int) -> dict[str, torch.Tensor]:
    """Samples ``first .. first + mbs - 1`` collated: text tensors stacked ``[mbs, seq]``, images concatenated."""
    import torch

    rows = [sample(shape, args.seq, args.image_size, first + i, args.seed) for i in range(args.mbs)]
    return {k: (torch.cat if k in ("pixel_values", "image_grid_thw") else torch.stack)([r[k] for r in rows])
            for k in rows[0]}


# ---------------------------------------------------------------------------------------------------- FLOPs


@dataclass(frozen=True)
class Counts:
    """What :func:`training_flops` needs of a model: parameter counts by how often they apply, and widths."""

    n_llm: int  # per text token: decoder weights + final norm + LM head (no input embedding)
    llm_layers: int
    llm_attn_width: int  # heads · head_dim
    n_patch: int  # per ViT patch: patch embedding + blocks
    n_merge: int  # per merged token: merger(s)
    vit_width: int
    vit_layers: int
    merge: int
    window_layers: tuple[int, ...]  # Qwen2.5-VL: layers with window attention
    window_units: int  # window side in merged units
    total: int  # every parameter (for the JSON)


def model_counts(shape: Shape) -> Counts:
    """:class:`Counts` of ``shape``'s HF model, built on the meta device (no memory, no initialisation)."""
    import torch

    with torch.device("meta"):
        model = build_hf(shape)
    text, vision = model.config.text_config, model.config.vision_config
    n_llm = n_patch = n_merge = 0
    for name, p in model.named_parameters():
        if name.startswith("model.visual."):
            sub = name.removeprefix("model.visual.")
            if sub.startswith(("merger", "deepstack_merger")):
                n_merge += p.numel()
            elif not sub.startswith("pos_embed"):  # a lookup table, no matmul
                n_patch += p.numel()
        elif "embed_tokens" not in name:
            n_llm += p.numel()
    if text.tie_word_embeddings:  # named_parameters lists the shared tensor once, as the input embedding
        n_llm += text.vocab_size * text.hidden_size
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    full = set(getattr(vision, "fullatt_block_indexes", None) or range(vision.depth))
    windows = tuple(i for i in range(vision.depth) if i not in full)
    units = vision.window_size // vision.spatial_merge_size // vision.patch_size if windows else 0
    return Counts(n_llm, text.num_hidden_layers, text.num_attention_heads * head_dim, n_patch, n_merge,
                  vision.hidden_size, vision.depth, vision.spatial_merge_size, windows, units,
                  sum(p.numel() for p in model.parameters()))


def _window_pairs(units_h: int, units_w: int, k: int, merge: int) -> int:
    """Σ over one frame's attention windows of (patches in the window)²: windows of k×k merged units, the last
    row/column of windows clipped to the grid."""
    rows = [min(k, units_h - i) for i in range(0, units_h, k)]
    cols = [min(k, units_w - j) for j in range(0, units_w, k)]
    return merge ** 4 * sum(r * r for r in rows) * sum(c * c for c in cols)


def training_flops(c: Counts, sequences: list[int], grids: list[tuple[int, int, int]]) -> float:
    """Training FLOPs (the module docstring's count) of attention documents of ``sequences`` tokens and images of
    ``grids`` ``(t, h, w)`` patches. A packed row passes each packed sample's length (attention stays inside it)."""
    llm = sum(6.0 * c.n_llm * s + 12.0 * c.llm_layers * c.llm_attn_width * s * s for s in sequences)
    vit = 0.0
    for t, h, w in grids:
        patches = t * h * w
        full = t * (h * w) ** 2
        win = t * _window_pairs(h // c.merge, w // c.merge, c.window_units, c.merge) if c.window_layers else 0
        pairs = (c.vit_layers - len(c.window_layers)) * full + len(c.window_layers) * win
        vit += 6.0 * c.n_patch * patches + 6.0 * c.n_merge * patches / c.merge ** 2 + 12.0 * c.vit_width * pairs
    return llm + vit


def step_flops(shape: Shape, args: argparse.Namespace) -> float:
    """Training FLOPs of one step of the rows' data: ``gbs`` sequences of ``seq`` tokens, one image each."""
    return training_flops(model_counts(shape), [args.seq] * args.gbs, [shape.grid(args.image_size)] * args.gbs)


def figures(shape: Shape, args: argparse.Namespace, step_s: list[float], losses: list[float],
            peak_gib: float | None) -> dict:
    """A row's result from its per-step wall times and losses (both for steps 1..steps, in order) and its peak
    device memory: medians after ``--warmup`` steps, tokens/s, ViT patches/s, MFU (None off CUDA)."""
    import torch

    if len(step_s) <= args.warmup:
        raise RuntimeError(f"{len(step_s)} timed steps leave none after --warmup {args.warmup}")
    s = statistics.median(step_s[args.warmup:])
    t, h, w = shape.grid(args.image_size)
    flops = step_flops(shape, args)
    return {"s_per_step": round(s, 4), "tokens_per_s": round(args.gbs * args.seq / s, 1),
            "vit_patches_per_s": round(args.gbs * t * h * w / s, 1), "tflop_per_step": round(flops / 1e12, 3),
            "mfu": round(flops / s / PEAK_BF16, 4) if torch.cuda.is_available() else None,
            "peak_memory_gib": None if peak_gib is None else round(peak_gib, 2),
            "loss_last": losses[-1], "losses": losses, "step_s": [round(x, 4) for x in step_s]}


# ---------------------------------------------------------------------------------------------------- HF rows


def build_hf(shape: Shape) -> torch.nn.Module:
    """``shape``'s HF ForConditionalGeneration (fp32, SDPA attention, train mode) on the current default device,
    its weights drawn from the current RNG state."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    cfg_cls, model_cls = {"qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
                          "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration)}[shape.family]
    cfg = cfg_cls(text_config=dict(shape.text), vision_config=dict(shape.vision), **shape.tokens,
                  tie_word_embeddings=shape.text["tie_word_embeddings"])
    return model_cls._from_config(cfg, attn_implementation="sdpa").train()


def _liger_entry_point(family: str) -> str:
    """Whether Liger's own entry point for ``family`` can import its fused-loss forward here ("ok" or the error)."""
    try:
        importlib.import_module(f"liger_kernel.transformers.model.{family}")
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _use_liger(family: str) -> None:
    """Put Liger's default kernels of ``family`` into transformers' modeling module (before the model is built):
    the module docstring's ``hf_liger`` row."""
    from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP
    from liger_kernel.transformers.rope import liger_rotary_pos_emb, liger_rotary_pos_emb_vision

    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mod

        mod.Qwen2_5_VLRMSNorm = LigerRMSNorm  # text norms, ViT block norms, merger norm
        mod.Qwen2MLP = LigerSwiGLUMLP  # the text MLP (the ViT's MLP has biases: Liger leaves it)
        mod.apply_rotary_pos_emb = liger_rotary_pos_emb  # text M-RoPE (sections already folded into cos/sin)
    else:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as mod

        mod.Qwen3VLTextRMSNorm = LigerRMSNorm  # text norms and q/k norms (Liger: offset 0, llama casting)
        mod.apply_rotary_pos_emb = liger_rotary_pos_emb
        mod.apply_rotary_pos_emb_vision = liger_rotary_pos_emb_vision


def _hf_loss(model: torch.nn.Module, mb: dict[str, torch.Tensor], liger: bool) -> torch.Tensor:
    inputs = {k: v for k, v in mb.items() if k != "labels"}
    if not liger:
        return model(**inputs, labels=mb["labels"], use_cache=False).loss
    from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss

    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    return LigerForCausalLMLoss(hidden_states=hidden, lm_head_weight=model.lm_head.weight, labels=mb["labels"],
                                hidden_size=model.config.text_config.hidden_size)


def _hf_row(shape: Shape, args: argparse.Namespace, liger: bool) -> dict:
    import torch

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    extra = {}
    if liger:
        extra["liger_entry_point"] = _liger_entry_point(shape.family)
        _use_liger(shape.family)
    torch.manual_seed(args.seed)
    with device:  # weights drawn on the device: drawing 3.75B of them on the host is slow
        model = build_hf(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=gpu)
    accum = args.gbs // args.mbs
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    times, losses = [], []
    for step in range(args.steps):
        mbs = [microbatch(shape, args, step * args.gbs + i * args.mbs) for i in range(accum)]  # the data loader's
        sync()
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for mb in mbs:
            mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
                loss = _hf_loss(model, mb, liger)
            (loss / accum).backward()
            total += loss.detach() / accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))  # the host sync a logging trainer makes every step too
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
    return {**figures(shape, args, times, losses, peak), **extra,
            "parameters": sum(p.numel() for p in model.parameters())}


def _hf_eager(shape: Shape, args: argparse.Namespace, tmp: Path) -> dict:
    return _hf_row(shape, args, liger=False)


def _hf_liger(shape: Shape, args: argparse.Namespace, tmp: Path) -> dict:
    return _hf_row(shape, args, liger=True)


# ---------------------------------------------------------------------------------------------------- Loong rows

#: loong-vlm's preset of each benchmark shape (the tiny CPU shapes map to loong-vlm's own tiny presets)
LOONG_PRESETS = {"qwen2_5_vl_3b": "qwen2_5_vl_3b", "qwen3_vl_2b": "qwen3_vl_2b", "qwen2_5_vl_tiny": "tiny",
                 "qwen3_vl_tiny": "tiny_qwen3_vl"}
_WORDS = ("red", "circle", "blue", "square", "a", "the", "and", "of", "picture", "shape", "left", "right",
          "green", "triangle", "yellow", "small", "large", "above", "below", "image")


def write_loong_data(shape: Shape, args: argparse.Namespace, folder: Path, packed: bool = False) -> tuple[Path, Path]:
    """The rows' data as ``loong-vlm train`` reads it: a conversations JSONL whose sample ``g`` holds the same
    ``--image-size``² noise image as :func:`sample` (saved as PNG) and an assistant answer of random words filling
    the sequence, and a tiny processor folder with the shape's patch geometry that resizes nothing (min = max
    pixels = the image's area). The text tokens differ from the HF rows' (loong-vlm tokenises text; the ids do
    not change the cost); the image tokens, their count and the sequence length are the same.

    ``packed``: the packed row's data instead: each sample's image side taken in turn from ``--packed-sizes``, rounded
    down to the family's patch x merge (dynamic resolution: the processor keeps each size, min / max pixels the
    smallest / largest) and its answer from 16 words
    to half the sequence, enough samples for ``--steps`` steps of packed sequences (a quarter more)."""
    import random

    import torch
    from PIL import Image

    from loong.vlm.data.processors import build_tiny_processor

    v = shape.vision
    factor = v["patch_size"] * v["spatial_merge_size"]  # the packed sizes rounded down to the family's grid
    sizes = sorted({max(x // factor, 1) * factor for x in args.packed_sizes}) if packed else [args.image_size]
    family = "qwen2_5_vl" if shape.family == "qwen2_5_vl" else "qwen3_vl"
    proc_dir = build_tiny_processor(folder / "processor", family, patch_size=v["patch_size"],
                                    merge_size=v["spatial_merge_size"], temporal_patch_size=v["temporal_patch_size"],
                                    min_pixels=min(sizes) ** 2, max_pixels=max(sizes) ** 2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(proc_dir))
    rng = random.Random(args.seed)
    probe = " ".join(rng.choice(_WORDS) for _ in range(2000))
    per_word = len(tok(probe)["input_ids"]) / 2000
    words = int((args.seq - shape.image_tokens(args.image_size) - 48) / per_word)  # the template's tokens: < 48
    n = args.steps * args.gbs
    if packed:
        words = int(args.seq / 2 / per_word)
        mean_tokens = 48 + sum(shape.image_tokens(x) for x in sizes) / len(sizes) + per_word * (16 + words) / 2
        n = int(1.25 * args.steps * args.gbs * args.seq / mean_tokens) + 1
    lines = []
    for g in range(n):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + g)  # sample()'s first draw: the image
        side = sizes[g % len(sizes)] if packed else args.image_size
        image = torch.randint(0, 256, (3, side, side), generator=gen, dtype=torch.uint8)
        path = folder / f"img_{g:05d}.png"
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(path)
        answer = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(16, words) if packed else words))
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": [{"type": "image", "image": path.name}, {"type": "text", "text": "Describe."}]},
            {"role": "assistant", "content": answer}]}))
    data = folder / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return data, proc_dir


def _loong_row(shape: Shape, args: argparse.Namespace, tmp: Path, extra: list[str], packed: bool = False) -> dict:
    """``loong-vlm train`` (the real walk: megatron engine, one rank, bf16) on :func:`write_loong_data`'s samples,
    one sample a sequence (``data.packing=false``) in order (samples are drawn by the seeded sampler: the same set,
    another order), constant learning rate; each step's wall time from its metrics record."""
    import torch

    from loong.core.run import train
    from loong.vlm.cli import CONFIG_MODULE, CONFIG_NAME
    from loong.vlm.schema import VLMRunConfig

    data, proc = write_loong_data(shape, args, tmp, packed)
    gpu = torch.cuda.is_available()
    overrides = [f"model={LOONG_PRESETS[shape.name]}", f"data.path={data}", f"data.processor={proc}",
                 f"data.packing={str(packed).lower()}", "data.valid_fraction=0", f"data.num_workers={4 if gpu else 0}",
                 f"train.seq_length={args.seq}", f"train.micro_batch_size={args.mbs}",
                 f"train.global_batch_size={args.gbs}", f"train.steps={args.steps}", f"train.lr={args.lr}",
                 f"train.min_lr={args.lr}", "train.warmup_steps=0", f"train.seed={args.seed}",
                 f"train.precision={'bf16' if gpu else 'fp32'}", "train.eval_interval=0", "train.eval_iters=0",
                 "train.save_final=false", "train.progress=false", "train.log_interval=1", "train.resume=none",
                 f"output_dir={tmp / 'out'}", "run_name=loong", *extra]
    if args.profile:
        overrides.append(f"train.profile_steps=[{args.profile[0]},{args.profile[1]}]")
    said = io.StringIO()  # the packed row reads its packing efficiency from the run's data summary line
    with contextlib.redirect_stderr(said) if packed else contextlib.nullcontext():
        result = train(CONFIG_MODULE, CONFIG_NAME, overrides, VLMRunConfig)
    sys.stderr.write(said.getvalue())
    recs = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "train_loss" in r]
    times = [b["time"] - a["time"] for a, b in zip(recs, recs[1:], strict=False)]  # steps 2..n
    peak = max((r.get("peak_memory_gib") or 0.0) for r in recs) or None
    out = figures(shape, args, [times[0], *times], [r["train_loss"] for r in recs], peak)
    out["overrides"] = overrides
    if packed:  # the real (non-padding) tokens of a step: gbs sequences of seq at the data's packing efficiency
        found = re.search(r"packing efficiency ([0-9.]+)%", said.getvalue())
        if found is None:
            raise RuntimeError("the run printed no data summary with its packing efficiency")
        out["packing_efficiency"] = float(found.group(1)) / 100
        out["tokens_per_s"] = round(args.gbs * args.seq * out["packing_efficiency"] / out["s_per_step"], 1)
        out.update(vit_patches_per_s=None, tflop_per_step=None, mfu=None)  # images of several sizes per step
    ops = result.run_dir / "profile" / "ops.txt"
    if ops.exists():
        out["profile_ops"] = ops.read_text().splitlines()[:45]
    return out


def _loong_bf16(shape: Shape, args: argparse.Namespace, tmp: Path) -> dict:
    return _loong_row(shape, args, tmp, [])


def _loong_selective(shape: Shape, args: argparse.Namespace, tmp: Path) -> dict:
    return _loong_row(shape, args, tmp, ["foundation.recompute=selective"])


def _loong_packed(shape: Shape, args: argparse.Namespace, tmp: Path) -> dict:
    return _loong_row(shape, args, tmp, [], packed=True)


#: the memory-lean overrides: megatron's selective recompute in the foundation, the ViT's blocks recomputed (about
#: 5% of the step's FLOPs at the published shape), gradients kept in bf16
LEAN = ["foundation.recompute=selective", "encoder.recompute=true", "train.grad_reduce_in_bf16=true"]


def _loong_lean(shape: Shape, args: argparse.Namespace, tmp: Path) -> dict:
    return _loong_row(shape, args, tmp, LEAN)


def _loong_fp8(shape: Shape, args: argparse.Namespace, tmp: Path) -> dict:
    return _loong_row(shape, args, tmp, ["precision.fp8=tensorwise"])


def _loong_fp8_lean(shape: Shape, args: argparse.Namespace, tmp: Path) -> dict:
    return _loong_row(shape, args, tmp, ["precision.fp8=tensorwise", *LEAN])


@dataclass(frozen=True)
class Row:
    """A benchmark row: its table label, the function that runs it (in the row's own process; returns
    :func:`figures` plus anything else for the JSON), and, if it cannot run without CUDA, why."""

    label: str
    run: Callable[[Shape, argparse.Namespace, Path], dict]
    cpu: str | None = None


_BF16_ONLY = "train.grad_reduce_in_bf16 needs bf16 training (rows without CUDA run in fp32)"
_NO_FP8 = "FP8 matrix products need a GPU of compute capability >= 8.9"
ROWS: dict[str, Row] = {
    "hf_eager": Row("HF eager (SDPA, bf16 autocast)", _hf_eager),
    "hf_liger": Row("HF + Liger kernels", _hf_liger,
                    cpu="Liger's kernels are Triton GPU kernels (no CPU implementation)"),
    "loong_bf16": Row("Loong bf16 (loong-vlm train)", _loong_bf16),
    "loong_selective": Row("Loong bf16, foundation.recompute=selective", _loong_selective),
    "loong_packed": Row("Loong bf16 packed, mixed sizes", _loong_packed),
    "loong_lean": Row("Loong bf16 lean", _loong_lean, cpu=_BF16_ONLY),
    "loong_fp8": Row("Loong FP8 tensorwise", _loong_fp8, cpu=_NO_FP8),
    "loong_fp8_lean": Row("Loong FP8 tensorwise lean", _loong_fp8_lean, cpu=_NO_FP8),
}


# ---------------------------------------------------------------------------------------------------- harness


def _worker(args: argparse.Namespace) -> None:
    """One row on one model in this process; prints one JSON line."""
    row, shape = ROWS[args.worker], SHAPES[args.preset][args.model]
    if row.cpu:
        import torch

        if not torch.cuda.is_available():
            print(json.dumps({"skipped": row.cpu}))
            return
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(row.run(shape, args, Path(tmp))))


def _run(name: str, model: str, args: argparse.Namespace) -> dict:
    settings = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SETTINGS if k != "packed_sizes"]
    cmd = [sys.executable, __file__, f"--worker={name}", f"--model={model}", *settings,
           "--packed-sizes", *map(str, args.packed_sizes),
           *(["--profile", *map(str, args.profile)] if args.profile else [])]
    t0 = time.time()
    proc = run_child(cmd)
    command = " ".join(["python", "benchmarks/" + Path(__file__).name, *cmd[2:]])
    if proc.returncode:
        tail = proc.stderr[-3000:]
        return {"error": "out of memory" if "OutOfMemoryError" in tail else tail, "command": command}
    return {"command": command, **json.loads(proc.stdout.strip().splitlines()[-1]),
            "wall_s": round(time.time() - t0, 1)}


def table(rows: dict[str, dict], args: argparse.Namespace) -> list[str]:
    """The printed table: one block per model, its rows against that model's ``hf_eager``."""
    lines = [f"{'row':<34}{'s/step':>8}{'tokens/s':>10}{'patches/s':>11}{'MFU':>7}{'peak GiB':>10}{'loss':>9}"
             f"{'vs eager':>10}{'mem vs eager':>14}"]
    for model in dict.fromkeys(k.split("/")[0] for k in rows):
        base = rows.get(f"{model}/hf_eager", {})
        lines.append(model)
        for key, r in rows.items():
            if key.split("/")[0] != model:
                continue
            name = key.split("/")[1]
            label = "  " + (ROWS[name].label if name in ROWS else name)
            if "error" in r or "skipped" in r:
                why = r.get("skipped") or r["error"].strip().splitlines()[-1]
                lines.append(f"{label:<34}  {'skipped' if 'skipped' in r else 'failed'}: {why[:90]}")
                continue
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
            patches = f"{r['vit_patches_per_s']:,.0f}" if r.get("vit_patches_per_s") is not None else "-"
            mem = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") is not None else "-"
            vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if "tokens_per_s" in base else "-"
            mvs = (f"{r['peak_memory_gib'] / base['peak_memory_gib']:.2f}x"
                   if r.get("peak_memory_gib") and base.get("peak_memory_gib") else "-")
            lines.append(f"{label:<34}{r['s_per_step']:>8.3f}{r['tokens_per_s']:>10,.0f}"
                         f"{patches:>11}{mfu:>7}{mem:>10}{r['loss_last']:>9.4f}{vs:>10}{mvs:>14}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--preset", choices=list(SHAPES), default="published", help="published shapes or tiny ones (CPU)")
    p.add_argument("--models", nargs="+", default=["qwen2_5_vl", "qwen3_vl"], choices=["qwen2_5_vl", "qwen3_vl"])
    p.add_argument("--seq", type=int, default=None, help="tokens per sample, image tokens included "
                                                         "(default: 4096 published, 256 tiny)")
    p.add_argument("--image-size", type=int, default=None,
                   help="side of each sample's square image, pixels (default: 448 published, 224 tiny)")
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="default: 14 published, 3 tiny")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (default: 4 / 1)")
    p.add_argument("--packed-sizes", type=int, nargs="+", default=None,
                   help="image sides of the packed row's samples, each rounded down to a multiple of the family's "
                        "patch x merge (default: 224 448 672 published, 112 224 tiny)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    p.add_argument("--profile", type=int, nargs=2, metavar=("START", "END"), default=None,
                   help="torch.profiler over these steps (1-based) of every Loong row; its top operators and the "
                        "window's device-busy line go into the JSON")
    p.add_argument("--merge", default=None, help="an earlier result JSON (same settings) to add these rows to")
    p.add_argument("--out", default=None, help="JSON path (default: results/vlm_throughput_<gpu>_<preset>_<date>.json)")
    p.add_argument("--worker", default=None, choices=list(ROWS), help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, choices=["qwen2_5_vl", "qwen3_vl"], help=argparse.SUPPRESS)
    args = p.parse_args()
    for k, v in PRESET_DEFAULTS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.worker:
        _worker(args)
        return
    if args.gbs % args.mbs:
        p.error(f"--gbs {args.gbs} is not a multiple of --mbs {args.mbs}")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup} to time")
    for model in args.models:  # fail here on a bad --image-size / --seq, not in every child
        shape = SHAPES[args.preset][model]
        if PREFIX_TOKENS + shape.image_tokens(args.image_size) + 2 > args.seq:
            p.error(f"--seq {args.seq} cannot hold {shape.name}'s {shape.image_tokens(args.image_size)} image tokens")
    rows: dict[str, dict] = {}
    commands: list[str] = []
    if args.merge:
        earlier = json.loads(Path(args.merge).read_text())
        differ = {k: (earlier["args"][k], getattr(args, k)) for k in SETTINGS if earlier["args"][k] != getattr(args, k)}
        if differ:
            p.error(f"--merge {args.merge}: settings differ (earlier, now): {differ}")
        rows, commands = earlier["rows"], earlier["commands"]
    for model in args.models:
        shape = SHAPES[args.preset][model]
        for name in args.rows:
            print(f"running {shape.name} / {name} ...", flush=True)
            r = rows[f"{shape.name}/{name}"] = _run(name, model, args)
            print(f"  {shape.name} / {name}: " + (
                f"{r['tokens_per_s']:,.0f} tokens/s, {r['s_per_step']:.3f} s/step, {r['wall_s']} s" if "tokens_per_s" in r
                else r.get("skipped") or "failed: " + r["error"].strip().splitlines()[-1][:200]), flush=True)
    order = [f"{SHAPES[args.preset][m].name}/{n}" for m in SHAPES[args.preset] for n in ROWS]
    rows = {k: rows[k] for k in order if k in rows}
    lines = table(rows, args)
    command = " ".join(["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]])
    heading = (f"{args.preset}: seq {args.seq} (one {args.image_size}² image each), micro-batch {args.mbs}, "
               f"global batch {args.gbs}, {args.steps} steps (medians after {args.warmup})")
    print(f"\n{heading}\n" + "\n".join(lines))
    hw = host()
    tag = (hw.get("gpu") or "cpu").split()[-1].lower()
    out = Path(args.merge or args.out or RESULTS / f"vlm_throughput_{tag}_{args.preset}_{time.strftime('%Y%m%d')}.json")
    result = {"benchmark": "vlm_throughput", "date": time.strftime("%Y-%m-%d"), "commands": [*commands, command],
              "args": {k: getattr(args, k) for k in (*SETTINGS, "models", "rows")},
              "heading": heading, "peak_flops": PEAK_BF16,
              "versions": versions(["torch", "transformers", "liger-kernel", "triton", "loong-core", "loong-llm",
                                    "loong-vlm"]),
              "hardware": hw, "table": lines, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
