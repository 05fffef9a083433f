"""Attention building blocks for any modality: packed (varlen) attention and context parallelism, torch only.

Three pieces, each usable alone, composed by :func:`cp_attention`:

- **Varlen attention** (:mod:`.varlen`): several samples packed into one sequence attend only within themselves,
  given per-token document ids ``[b, s]`` (negative = padding, output 0), without a dense ``[s, s]`` mask.
  :func:`varlen_attention` runs compiled FlexAttention where the accelerator reports ``flex_attention``, else a
  reference of one SDPA call per document. Causal or not, grouped-query K/V, cross-attention with ``kv_doc_ids``.
- **Ulysses** (:mod:`.ulysses`): DeepSpeed-Ulysses sequence parallelism; an all-to-all trades each rank's sequence
  shard (all heads) for the whole sequence of ``h/U`` heads, and back after attention.
- **Ring attention** (:mod:`.ring`): K/V chunks (and their document ids) pass round a ring of ranks; each step is
  one block of attention with its log-sum-exp (:mod:`.block`), merged by online softmax; the backward passes
  dK/dV round with the K/V. Exact gradients.

:func:`cp_attention` is what a model calls: q/k/v of this rank's sequence shard in SDPA layout ``[b, h, s, d]``,
:class:`CPGroups` (Ulysses inside, ring across; either of size 1), optional ``doc_ids``, and ``kv_replicated=True``
for cross-attention to a context every rank holds whole. :func:`shard_sequence` / :func:`gather_sequence` split and
reassemble sequences; :func:`cp_groups_from_group` / :func:`cp_groups_from_mesh` build the groups. A DiT block's
use is worked through in ``docs/context-parallel-attention.md``.

The megatron engine's context parallelism (megatron's zigzag split, all-gather causal attention) is separate and
lives with that engine.
"""

from __future__ import annotations

from loong.core.attention.block import block_backward, block_forward, merge_blocks
from loong.core.attention.context_parallel import (
    MESH_DIMS,
    CPGroups,
    cp_attention,
    cp_groups_from_group,
    cp_groups_from_mesh,
    gather_sequence,
    shard_sequence,
)
from loong.core.attention.ring import ring_attention
from loong.core.attention.ulysses import heads_to_seq, kv_head_repeat, seq_to_heads
from loong.core.attention.varlen import (
    FLEX,
    REFERENCE,
    VARLEN_IMPLS,
    choose_varlen_impl,
    cu_seqlens,
    flex_varlen_attention,
    reference_varlen_attention,
    varlen_attention,
)

__all__ = [
    "FLEX",
    "MESH_DIMS",
    "REFERENCE",
    "VARLEN_IMPLS",
    "CPGroups",
    "block_backward",
    "block_forward",
    "choose_varlen_impl",
    "cp_attention",
    "cp_groups_from_group",
    "cp_groups_from_mesh",
    "cu_seqlens",
    "flex_varlen_attention",
    "gather_sequence",
    "heads_to_seq",
    "kv_head_repeat",
    "merge_blocks",
    "reference_varlen_attention",
    "ring_attention",
    "seq_to_heads",
    "shard_sequence",
    "varlen_attention",
]
