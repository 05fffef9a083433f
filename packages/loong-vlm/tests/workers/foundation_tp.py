"""TP=2 foundation checks, run as ``torchrun --nproc-per-node 2 foundation_tp.py OUT_JSON``.

In one 2-process gloo launch: the Qwen3-VL foundation at TP=1, TP=2 and TP=2 with sequence parallelism, and the
Qwen3-VL-MoE one at TP=1 and TP=2 (sequence-parallel, as loong-llm runs MoE at TP > 1), on the same batch with
visual rows and DeepStack features: per-token losses, logits (gathered over the vocabulary shards), and the
gradients of the mean loss w.r.t. the visual rows, each DeepStack tensor and the word embeddings. Every rank builds
the same transformers model from the same seed. Then a CP=2 foundation's refusal of multimodal inputs. Rank 0
writes JSON; the pytest side compares.
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


def run(case: str, parallel: ParallelConfig, acc) -> dict:  # noqa: ANN001
    layout = init_distributed(acc, parallel)
    hf = hf_model(case)
    bt = batch(case, hf)
    model = build_loong(case, hf, layout, acc.capabilities(), parallel)
    vis = bt.visual_embeds.clone().requires_grad_()
    ds = [d.clone().requires_grad_() for d in bt.deepstack]
    kw = dict(visual_embeds=vis, visual_mask=bt.visual_mask, deepstack_embeds=ds)
    losses = model(bt.input_ids, bt.position_ids, None, labels=bt.labels, **kw)
    losses.mean().backward()
    with torch.no_grad():
        logits = model(bt.input_ids, bt.position_ids, None, **kw)
    tp = layout.pg_collection.tp
    shards = [torch.empty_like(logits) for _ in range(tp.size())]
    dist.all_gather(shards, logits.contiguous(), group=tp)
    grads = gather_full_state([model], source=lambda p: p.grad)
    out = {"tp": parallel.tp, "sequence_parallel": bool(model.config.sequence_parallel),
           "losses": losses.detach().tolist(), "logits": torch.cat(shards, dim=-1).tolist(),
           "visual_grad": vis.grad.tolist(), "embedding_grad": grads[EMBEDDING].tolist()}
    for i, d in enumerate(ds):
        out[f"deepstack_grad_{i}"] = d.grad.tolist()
    assert len(ds) == DEEPSTACK
    return out


def cp_refusal(acc) -> str:  # noqa: ANN001
    """The error a CP=2 foundation gives for multimodal inputs (empty if none)."""
    from loong.core.errors import LoongError

    layout = init_distributed(acc, ParallelConfig(cp=2))
    hf = hf_model("qwen3_vl")
    bt = batch("qwen3_vl", hf)
    model = build_loong("qwen3_vl", hf, layout, acc.capabilities(), ParallelConfig(cp=2))
    try:
        model(bt.input_ids, bt.position_ids, None, visual_embeds=bt.visual_embeds, visual_mask=bt.visual_mask)
    except LoongError as err:
        return str(err)
    return ""


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
        result["cp2_refusal"] = cp_refusal(acc)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
