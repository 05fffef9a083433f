"""Variable-length attention for packed sequences: documents attend only within themselves.

Several samples packed into one sequence carry per-token *document ids* ``[b, s]`` (integers; a negative id is
padding, which attends to nothing and whose output is 0). Two implementations compute the same thing without a
dense ``[s, s]`` mask:

- ``reference``: loops over the documents of each batch row and runs
  ``torch.nn.functional.scaled_dot_product_attention`` on each document's segment alone. Exact, any device,
  differentiable by autograd; the Python loop costs one SDPA call per document.
- ``flex``: one ``torch.nn.attention.flex_attention`` call with a block-sparse mask built from the document ids
  (``create_block_mask``), compiled with ``torch.compile``. Chosen when the accelerator reports
  :data:`~loong.core.accelerators.capabilities.FLEX_ATTENTION`; on the CPU torch 2.11 runs FlexAttention's
  forward only (no backward), so the CPU accelerator does not report it.

Inputs use SDPA's layout ``q [b, h, s, d]``, ``k``/``v [b, h_kv, s_kv, d(_v)]`` with grouped-query attention when
``h_kv < h`` (query head ``i`` reads key/value head ``i // (h // h_kv)``, as SDPA's ``enable_gqa`` and megatron do).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Collection, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from loong.core.accelerators.capabilities import FLEX_ATTENTION
from loong.core.errors import LoongError, did_you_mean

REFERENCE = "reference"
FLEX = "flex"
#: implementation name -> what it is
VARLEN_IMPLS: dict[str, str] = {
    REFERENCE: "one SDPA call per document segment (exact, any device)",
    FLEX: "compiled FlexAttention with a block mask from the document ids (needs the flex_attention capability)",
}

#: a span of one document inside a sequence: a slice when the document is one contiguous run (the packed
#: case, a view), else the token indices
Span = slice | torch.Tensor


def choose_varlen_impl(capabilities: Collection[str] = (), impl: str | None = None) -> str:
    """``impl`` when given (checked), else ``flex`` where the accelerator reports ``flex_attention``, else
    ``reference``."""
    if impl is None:
        return FLEX if FLEX_ATTENTION in capabilities else REFERENCE
    if impl not in VARLEN_IMPLS:
        raise LoongError(f"unknown attention implementation '{impl}'{did_you_mean(impl, VARLEN_IMPLS)} "
                         f"(known: {', '.join(VARLEN_IMPLS)})")
    return impl


def _runs(row: torch.Tensor) -> dict[int, list[tuple[int, int]]]:
    """Document id -> its ``(start, end)`` runs in one row of ids (padding, a negative id, left out)."""
    ids, counts = torch.unique_consecutive(row, return_counts=True)
    runs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    at = 0
    for doc, n in zip(ids.tolist(), counts.tolist(), strict=True):
        if doc >= 0:
            runs[doc].append((at, at + n))
        at += n
    return runs


def _span(runs: list[tuple[int, int]], device: torch.device) -> Span:
    if len(runs) == 1:
        return slice(*runs[0])
    return torch.cat([torch.arange(a, b, device=device) for a, b in runs])


def document_spans(q_doc: torch.Tensor, kv_doc: torch.Tensor) -> Iterator[tuple[Span, Span]]:
    """``(query span, key span)`` of every document present among both the queries and the keys of one row.

    ``q_doc [s]`` and ``kv_doc [s_kv]`` are the ids of one batch row's queries and keys (the same tensor for
    self-attention). A document may be split into several runs; its spans are then index tensors.
    """
    q_runs = _runs(q_doc)
    kv_runs = q_runs if kv_doc is q_doc else _runs(kv_doc)
    for doc, runs in q_runs.items():
        if doc in kv_runs:
            yield _span(runs, q_doc.device), _span(kv_runs[doc], kv_doc.device)


def cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32 [n + 1], max_seqlen)`` of the runs of equal id in ``doc_ids [b, s]`` flattened to
    ``[b * s]``: the offsets flash-attn's and Transformer Engine's varlen (THD) kernels take.

    Padding runs are segments too, so that the offsets index the flattened tensor; their outputs are the
    caller's to zero. Each batch row starts a new segment even when its first id equals the previous row's last.
    """
    b, s = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    edges = torch.nonzero(starts.flatten()).flatten()
    cu = torch.cat([edges, edges.new_tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
                  kv_doc_ids: torch.Tensor | None, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [b, h, s, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} key/value heads")
    if doc_ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be [b, s] = {(q.shape[0], q.shape[2])}")
    kv = doc_ids if kv_doc_ids is None else kv_doc_ids
    if kv.shape != (k.shape[0], k.shape[2]):
        raise ValueError(f"key document ids {tuple(kv.shape)} must be [b, s_kv] = {(k.shape[0], k.shape[2])}")
    if causal and kv_doc_ids is not None:
        raise ValueError("causal varlen attention is self-attention: pass doc_ids only, not kv_doc_ids")


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, *,
                               kv_doc_ids: torch.Tensor | None = None, causal: bool = False,
                               scale: float | None = None) -> torch.Tensor:
    """Varlen attention as one SDPA call per document segment; rows of padding queries are 0.

    Differentiable by autograd. ``kv_doc_ids`` (cross-attention) gives the keys their own ids; default: the
    queries' ``doc_ids``.
    """
    _check_shapes(q, k, v, doc_ids, kv_doc_ids, causal)
    kv_ids = doc_ids if kv_doc_ids is None else kv_doc_ids
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    gqa = q.shape[1] != k.shape[1]
    for b in range(q.shape[0]):
        row = doc_ids[b]
        for qs, ks in document_spans(row, row if kv_doc_ids is None else kv_ids[b]):
            # [h, n, d] -> [1, h, n, d]: one document is a batch of one
            qq, kk, vv = q[b, :, qs][None], k[b, :, ks][None], v[b, :, ks][None]
            out[b, :, qs] = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale,
                                                           enable_gqa=gqa)[0]
    return out


class _BlockMaskCache:
    """The last few block masks, keyed by the document-id tensors' memory and version.

    Every attention layer of a model gets the same document ids for a micro-batch (the LLM's decoder layers, a
    ViT's window or frame ids), and building the mask costs host work and a few kernel launches per call: on an
    H200 the Qwen2.5-VL-3B step (68 attention layers, 4 micro-batches) built 272 masks a step. A hit needs the
    same data pointer, shape, strides, dtype, device and version counter (in-place writes bump it) of both id
    tensors, and the entry holds the ids themselves, so their memory cannot be freed and reused by other ids
    while the entry lives: equal keys mean equal ids. A few entries cover a model's distinct id tensors (window
    and frame ids of a ViT, the decoder's ids) without keeping old micro-batches alive for long."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: dict[tuple, tuple[tuple, Any]] = {}

    @staticmethod
    def _key(t: torch.Tensor | None) -> tuple:
        if t is None:
            return (None,)
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)

    def get_or_build(self, q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None, extra: tuple,
                     build: Any) -> Any:
        if torch.compiler.is_compiling():  # traced ids have no memory to key on; the graph holds the mask
            return build()
        key = (self._key(q_doc), self._key(kv_doc), *extra)
        hit = self._entries.get(key)
        if hit is not None:
            return hit[1]
        mask = build()
        if len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))  # the oldest
        self._entries[key] = ((q_doc, kv_doc), mask)
        return mask


_MASKS = _BlockMaskCache()


def flex_document_mask(q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None, causal: bool, q_len: int,
                       kv_len: int, *, batch: int, device: torch.device, compile: bool = True) -> Any:
    """FlexAttention ``BlockMask`` for document ids (``[b, s]`` / ``[b, s_kv]``, or None: every key) and a causal
    flag (aligned: query ``i`` sees keys ``0..i``); None when nothing is masked.

    ``compile`` builds it with a compiled mask function: uncompiled, ``create_block_mask`` evaluates the mask
    over the whole ``[b, s, s_kv]`` grid, the very tensor varlen attention exists to avoid. Masks of the same
    ids are built once (:class:`_BlockMaskCache`): the layers of a model share them.
    """
    if q_doc is None and not causal:
        return None
    return _MASKS.get_or_build(q_doc, kv_doc, (causal, q_len, kv_len, batch, torch.device(device), compile),
                               lambda: _build_document_mask(q_doc, kv_doc, causal, q_len, kv_len, batch=batch,
                                                            device=device, compile=compile))


def _build_document_mask(q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None, causal: bool, q_len: int,
                         kv_len: int, *, batch: int, device: torch.device, compile: bool) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = q_idx >= kv_idx if causal else q_idx >= 0
        if q_doc is not None:
            qd = q_doc[b, q_idx]
            keep = keep & (qd == kv_doc[b, kv_idx]) & (qd >= 0)
        return keep

    return create_block_mask(mask_mod, batch if q_doc is not None else None, None, q_len, kv_len, device=device,
                             _compile=compile)


@functools.cache
def _compiled_flex_attention() -> Any:
    """FlexAttention compiled once per process: an uncompiled call materialises the full score matrix.

    Shapes stay automatic-dynamic (torch.compile's default): balanced SFT micro-batches change the sequence length,
    and a static compile would recompile for each until its cache limit, then fall back to the eager path.
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_attention_call(compile: bool) -> Any:
    """``flex_attention`` compiled (the fused kernel) or eager (CPU tests: forward only under torch 2.11)."""
    if compile:
        return _compiled_flex_attention()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def flex_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, *,
                          kv_doc_ids: torch.Tensor | None = None, causal: bool = False, scale: float | None = None,
                          compile: bool = True) -> torch.Tensor:
    """Varlen attention as one FlexAttention call over a block mask from the document ids.

    ``compile=False`` runs FlexAttention eagerly (a slow, unfused path kept for CPU tests of the forward).
    """
    _check_shapes(q, k, v, doc_ids, kv_doc_ids, causal)
    kv_ids = doc_ids if kv_doc_ids is None else kv_doc_ids
    mask = flex_document_mask(doc_ids, kv_ids, causal, q.shape[2], k.shape[2], batch=q.shape[0], device=q.device,
                              compile=compile)
    return flex_attention_call(compile)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, *,
                     kv_doc_ids: torch.Tensor | None = None, causal: bool = False, scale: float | None = None,
                     capabilities: Collection[str] = (), impl: str | None = None) -> torch.Tensor:
    """Attention of packed documents, each to itself: ``q [b, h, s, d]``, ``k``/``v [b, h_kv, s_kv, d(_v)]``,
    ``doc_ids [b, s]`` (negative = padding: output 0, never NaN) -> ``[b, h, s, d_v]``.

    ``causal`` masks future tokens inside each document (self-attention only). ``kv_doc_ids [b, s_kv]`` gives the
    keys their own ids (cross-attention of packed samples to their packed contexts). ``scale`` defaults to
    ``1/sqrt(d)``. The implementation is ``impl`` if given, else chosen from the accelerator's ``capabilities``
    (:func:`choose_varlen_impl`).
    """
    if choose_varlen_impl(capabilities, impl) == FLEX:
        return flex_varlen_attention(q, k, v, doc_ids, kv_doc_ids=kv_doc_ids, causal=causal, scale=scale)
    return reference_varlen_attention(q, k, v, doc_ids, kv_doc_ids=kv_doc_ids, causal=causal, scale=scale)


__all__ = ["FLEX", "REFERENCE", "VARLEN_IMPLS", "choose_varlen_impl", "cu_seqlens", "document_spans",
           "flex_attention_call", "flex_document_mask", "flex_varlen_attention", "reference_varlen_attention",
           "varlen_attention"]
