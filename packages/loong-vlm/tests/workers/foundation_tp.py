"""TP=2 foundation checks, run as ``torchrun --nproc-per-node 2 foundation_tp.py OUT_JSON``.

In one 2-process gloo launch: the Qwen3-VL foundation at TP=1, TP=2 and TP=2 with sequence parallelism, and the
Qwen3-VL-MoE one at TP=1 and TP=2 (sequence-parallel, as loong-llm runs MoE at TP > 1), on the same batch with
visual rows and DeepStack features: per-token losses, logits (gathered over the vocabulary shards), and the
gradients of the mean loss w.r.t. the visual rows, each DeepStack tensor and the word embeddings. Every rank builds
the same transformers model from the same seed. Then CP=2 (each rank its two zigzag chunks of every row, the
visual rows placed by their whole-row numbering) against TP=1, with causal rows and with packed rows of documents
and padding (Qwen3-VL with DeepStack, Qwen2.5-VL with a video). Rank 0 writes JSON; the pytest side compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))
from foundation_cases import DEEPSTACK, batch, build_loong, hf_model  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.config.schema import ParallelConfig  # noqa: E402
from loong.core.engines.megatron.layout import init_distributed  # noqa: E402
from loong.core.engines.megatron.state import gather_full_state  # noqa: E402

EMBEDDING = "embedding.word_embeddings.weight"


def documents(bt) -> torch.Tensor:  # noqa: ANN001
    """Packed rows: row 0 holds two documents (the image in the first, the video or second image in the second),
    row 1 two documents and two padding slots (negative ids)."""
    b, s = bt.input_ids.shape
    docs = torch.zeros(b, s, dtype=torch.long)
    docs[0, 14:] = 1
    docs[1, 22:] = 1
    docs[1, 26:] = -1
    return docs


def run(case: str, parallel: ParallelConfig, acc, packed: bool = False) -> dict:  # noqa: ANN001
    """Per-token losses, logits, and the gradients of the batch's mean loss, whole (gathered over TP's vocabulary
    shards, CP's sequence chunks, and summed over CP, where each rank holds its chunks' share)."""
    from loong.core.engines.megatron.context_parallel import gather_rows, split_for_cp_rank

    layout = init_distributed(acc, parallel)
    hf = hf_model(case)
    bt = batch(case, hf)
    model = build_loong(case, hf, layout, acc.capabilities(), parallel)
    cp = layout.pg_collection.cp if parallel.cp > 1 else None

    def local(t: torch.Tensor | None) -> torch.Tensor | None:  # this CP rank's chunks of per-token rows
        return t if cp is None or t is None else split_for_cp_rank(t, t.dim() - 1, cp.size(), cp.rank())

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t if cp is None else gather_rows(t, cp)

    vis = bt.visual_embeds.clone().requires_grad_()
    ds = [d.clone().requires_grad_() for d in bt.deepstack]
    kw = dict(visual_embeds=vis, visual_mask=bt.visual_mask, deepstack_embeds=ds)
    args = (local(bt.input_ids), local(bt.position_ids), local(documents(bt) if packed else None))
    losses = model(*args, labels=local(bt.labels), **kw)
    (losses.sum() / bt.labels.numel()).backward()  # the mean over the whole batch, each rank its share
    with torch.no_grad():
        logits = whole(model(*args, **kw))
    tp = layout.pg_collection.tp
    shards = [torch.empty_like(logits) for _ in range(tp.size())]
    dist.all_gather(shards, logits.contiguous(), group=tp)
    if cp is not None:  # each CP rank's gradients are its chunks' share
        for t in (*model.parameters(), vis, *ds):
            dist.all_reduce(t.grad, group=cp)
    grads = gather_full_state([model], source=lambda p: p.grad)
    out = {"tp": parallel.tp, "sequence_parallel": bool(model.config.sequence_parallel),
           "losses": whole(losses.detach()).tolist(), "logits": torch.cat(shards, dim=-1).tolist(),
           "visual_grad": vis.grad.tolist(), "embedding_grad": grads[EMBEDDING].tolist()}
    for i, d in enumerate(ds):
        out[f"deepstack_grad_{i}"] = d.grad.tolist()
    assert len(ds) == (0 if case == "qwen2_5_vl" else DEEPSTACK)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    acc = select_accelerator("cpu")
    runs = {"qwen3_vl/tp1": ParallelConfig(), "qwen3_vl/tp2": ParallelConfig(tp=2),
            "qwen3_vl/tp2_sp": ParallelConfig(tp=2, sequence_parallel=True),
            "qwen3_vl_moe/tp1": ParallelConfig(), "qwen3_vl_moe/tp2": ParallelConfig(tp=2)}
    result = {}
    with acc.activate():
        for name, parallel in runs.items():
            result[name] = run(name.split("/")[0], parallel, acc)
        result["qwen3_vl/cp2"] = run("qwen3_vl", ParallelConfig(cp=2), acc)
        result["qwen3_vl/tp1_packed"] = run("qwen3_vl", ParallelConfig(), acc, packed=True)
        result["qwen3_vl/cp2_packed"] = run("qwen3_vl", ParallelConfig(cp=2), acc, packed=True)
        result["qwen2_5_vl/tp1_packed"] = run("qwen2_5_vl", ParallelConfig(), acc, packed=True)
        result["qwen2_5_vl/cp2_packed"] = run("qwen2_5_vl", ParallelConfig(cp=2), acc, packed=True)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
