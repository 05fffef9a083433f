"""SFT: chat formats, chat templates and assistant masks, packing, per-token RoPE, the packed-equals-
unpacked oracle, and ``loong-llm train task=sft`` end to end (CPU, fp32, world of one)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loong.core.errors import LoongError
from loong.llm.data.tokenizer import build_packaged_tokenizer
from loong.llm.sft.formats import normalise, read_conversations
from loong.llm.sft.packing import (
    Document,
    PackedSequences,
    fit_documents,
    make_sft_microbatch,
    pack_best_fit,
)
from loong.llm.sft.task import packaged_chat_path
from loong.llm.sft.templates import (
    LLAMA3_TEMPLATE,
    QWEN_TEMPLATE,
    ChatTemplate,
    encode_conversation,
    resolve_template,
)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is len?"},
        {"role": "assistant", "content": "It counts items"}, {"role": "user", "content": "And abs?"},
        {"role": "assistant", "content": "The absolute value"}]  # fmt: skip


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok():
    return build_packaged_tokenizer()


# --- formats -----------------------------------------------------------------------------------
def test_three_formats_normalise_to_messages(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "hello"}]},
        {"instruction": "Add", "input": "1 and 2", "output": "3", "system": "math"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
    ]  # fmt: skip
    convs, stats = read_conversations(_jsonl(tmp_path / "c.jsonl", rows))
    assert [c.line for c in convs] == [1, 2, 3, 4]
    assert convs[0].messages == rows[0]["messages"]
    assert convs[1].messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello"}]  # fmt: skip
    assert convs[2].messages == [{"role": "system", "content": "math"}, {"role": "user", "content": "Add\n\n1 and 2"},
                                 {"role": "assistant", "content": "3"}]  # fmt: skip
    assert convs[3].messages == [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    assert dict(stats.formats) == {"messages": 1, "sharegpt": 1, "alpaca": 2} and stats.skipped_lines == 0


def test_forced_format_and_content_parts() -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "c"}]}  # fmt: skip
    assert normalise(parts, "messages")[0][0]["content"] == "ab"
    with pytest.raises(ValueError, match="no 'conversations' field"):
        normalise(parts, "sharegpt")


BAD = [
    ("{not json", "not valid JSON", "invalid JSON"),
    ({"text": "plain"}, "cannot tell the chat format", "unknown format"),
    ({"messages": []}, "conversation is empty", "empty conversation"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn", "no assistant turn"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "messages\\[0\\] has no 'content'",
     "missing field"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "'bot' is not one of", "unknown role"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 3}]}, "is not a string",
     "bad content"),
    ({"instruction": "q"}, "no 'output' field", "missing field"),
    ([1, 2], "expected a JSON object", "not an object"),
]  # fmt: skip


@pytest.mark.parametrize("row,message,kind", BAD)
def test_bad_lines_name_file_and_line(tmp_path: Path, row, message: str, kind: str) -> None:
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = _jsonl(tmp_path / "bad.jsonl", [good, good, row, good])
    with pytest.raises(LoongError, match=f"bad.jsonl:3: .*{message}"):
        read_conversations(path)
    convs, stats = read_conversations(path, on_error="skip")
    assert [c.line for c in convs] == [1, 2, 4] and dict(stats.skipped) == {kind: 1} and stats.lines == 4


def test_no_usable_conversation_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LoongError, match="no usable conversation"):
        read_conversations(_jsonl(tmp_path / "c.jsonl", ["{oops"]), on_error="skip")


def test_chat_example_ships_fifty_conversations() -> None:
    convs, stats = read_conversations(packaged_chat_path())
    assert len(convs) == 50 and dict(stats.formats) == {"messages": 50}


# --- templates ---------------------------------------------------------------------------------
def test_packaged_templates_render_the_official_formats(tok) -> None:
    llama3 = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nWhat is len?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nIt counts items<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nAnd abs?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nThe absolute value<|eot_id|>")  # fmt: skip
    qwen = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is len?<|im_end|>\n"
            "<|im_start|>assistant\nIt counts items<|im_end|>\n<|im_start|>user\nAnd abs?<|im_end|>\n"
            "<|im_start|>assistant\nThe absolute value<|im_end|>\n")  # fmt: skip
    render = tok.hf.apply_chat_template
    assert render(CHAT, chat_template=LLAMA3_TEMPLATE, tokenize=False) == llama3
    assert render(CHAT, chat_template=QWEN_TEMPLATE, tokenize=False) == qwen
    prompt = render(CHAT[:2], chat_template=QWEN_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("What is len?<|im_end|>\n<|im_start|>assistant\n")
    prompt = render(CHAT[:2], chat_template=LLAMA3_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def _masked_text(hf, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of consecutive masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(hf.decode(cur))
            cur = []
    return runs + ([hf.decode(cur)] if cur else [])


@pytest.mark.parametrize("name,end", [("qwen", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_assistant_mask_is_content_and_end_marker(tok, name: str, end: str) -> None:
    template = resolve_template(name, tok.hf)
    ids, mask = encode_conversation(tok.hf, template, CHAT)
    assert tok.hf.decode(ids) == tok.hf.apply_chat_template(CHAT, chat_template=template.source, tokenize=False)
    assert _masked_text(tok.hf, ids, mask) == [f"It counts items{end}", f"The absolute value{end}"]


def _strip_generation(source: str) -> str:
    return source.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")


@pytest.mark.parametrize("source", [QWEN_TEMPLATE, LLAMA3_TEMPLATE])
def test_tokenizer_template_with_and_without_generation_blocks(tok, source: str) -> None:
    """The tokenizer's own Jinja template; without {% generation %} the mask comes from prefixes."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok.hf.backend_tokenizer, eos_token="<|endoftext|>")
    hf.chat_template = _strip_generation(source)
    plain = resolve_template("auto", hf)
    assert plain.name == "tokenizer" and not plain.has_generation
    hf.chat_template = source
    marked = resolve_template("auto", hf)
    assert marked.name == "tokenizer" and marked.has_generation
    assert encode_conversation(hf, plain, CHAT) == encode_conversation(hf, marked, CHAT)
    ids, mask = encode_conversation(hf, plain, CHAT)
    assert len(_masked_text(hf, ids, mask)) == 2 and sum(mask) > 0


def test_template_choice_and_errors(tok) -> None:
    assert resolve_template("auto", tok.hf).name == "qwen"  # the packaged tokenizer has no template
    assert resolve_template("chatml", tok.hf).source == QWEN_TEMPLATE
    with pytest.raises(LoongError, match="unknown template 'qwenn'.*did you mean 'qwen'"):
        resolve_template("qwenn", tok.hf)
    with pytest.raises(LoongError, match="has no chat template"):
        resolve_template("tokenizer", tok.hf)
    # a template whose earlier text depends on later turns cannot be split by prefixes
    odd = ChatTemplate("odd", "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(LoongError, match="not prefix-consistent"):
        encode_conversation(tok.hf, odd, CHAT)


# --- packing -----------------------------------------------------------------------------------
def test_best_fit_packing_respects_capacity() -> None:
    lengths = [7, 3, 5, 2, 9, 1, 4, 6]
    bins = pack_best_fit(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4 and bins == pack_best_fit(lengths, 10)  # 37 tokens in 4 bins, deterministic


def test_fit_documents_truncates_or_drops() -> None:
    enc = [([1, 2, 3], [0, 1, 1]), (list(range(10)), [0] * 5 + [1] * 5), (list(range(10)), [0] * 8 + [1] * 2)]
    docs, stats = fit_documents(enc, seq_length=6, overlong="truncate")
    assert (stats.kept, stats.truncated, stats.dropped) == (2, 2, 1)  # the third keeps no assistant token
    assert [len(d) for d in docs] == [2, 6] and docs[1].loss.tolist() == [0, 0, 0, 0, 1, 1]
    docs, stats = fit_documents(enc, seq_length=6, overlong="drop")
    assert (stats.kept, stats.truncated, stats.dropped) == (1, 0, 2)


def test_packed_sequence_layout() -> None:
    enc = [([10, 11, 12, 13], [0, 0, 1, 1]), ([20, 21, 22], [0, 1, 1]), ([30, 31, 32, 33, 34], [0, 0, 0, 1, 1])]
    docs, _ = fit_documents(enc, seq_length=8)
    packed = PackedSequences(docs, 8, packing=True, pad_id=0)
    assert packed.bins == [[2, 0], [1]] and packed.real_tokens == 9
    assert packed.efficiency == pytest.approx(9 / 16) and packed.loss_tokens.tolist() == [4, 2]
    s = packed[0]
    assert s["tokens"].tolist() == [30, 31, 32, 33, 10, 11, 12, 0]
    assert s["labels"][:7].tolist() == [31, 32, 33, 34, 11, 12, 13]
    assert s["loss_mask"].tolist() == [0, 0, 1, 1, 0, 1, 1, 0]  # shifted: a label in the loss is an assistant token
    assert s["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert s["doc_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, -1]
    unpacked = PackedSequences(docs, 8, packing=False, pad_id=0)
    assert unpacked.bins == [[0], [1], [2]] and unpacked[1]["position_ids"].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]


def test_microbatch_carries_document_ids() -> None:
    """The micro-batch holds document ids [b, s] for the attention, not a dense [b, 1, s, s] mask."""
    from loong.llm.models.attention import is_document_ids

    sample = {"tokens": np.zeros(5), "doc_ids": np.array([0, 0, 1, 1, -1])}
    batch = make_sft_microbatch([sample, sample])
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, -1]] * 2 and batch["attention_mask"].dtype == torch.int64
    assert is_document_ids(batch["attention_mask"]) and "doc_ids" not in batch
    assert not is_document_ids(torch.ones(2, 1, 5, 5, dtype=torch.bool)) and not is_document_ids(None)
    # without the document mask the whole sequence is one document: plain causal attention
    assert make_sft_microbatch([sample], document_mask=False)["attention_mask"].tolist() == [[0] * 5]


# --- the model: per-token RoPE and the packing oracle ------------------------------------------
@pytest.fixture()
def cpu():
    """A world of one on the CPU accelerator (per test: the end-to-end run makes its own)."""
    from loong.core.accelerators import select_accelerator
    from loong.core.config.schema import ParallelConfig
    from loong.core.engines.megatron.layout import init_distributed, shutdown_distributed

    acc = select_accelerator("cpu")
    with acc.activate():
        try:
            yield acc, init_distributed(acc, ParallelConfig())
        finally:
            shutdown_distributed()


def _model(cpu, gpt_cls: type | None = None, llama3_scaling: bool = False):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong.core.config.schema import ParallelConfig
    from loong.llm.models import build
    from loong.llm.models.config import DenseModelConfig, RopeScaling

    acc, layout = cpu
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    kw = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
              max_position_embeddings=512, init_std=0.2)  # fmt: skip
    cfg = DenseModelConfig(**kw, rope_scaling=RopeScaling(original_max_position_embeddings=64) if llama3_scaling else None)
    tc = build.transformer_config(cfg, ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
    with pytest.MonkeyPatch.context() as mp:
        if gpt_cls is not None:  # the stock class takes no fused_kernels plan (nothing is fused on CPU)
            mp.setattr(build, "LoongGPTModel", lambda *a, fused_kernels=None, **k: gpt_cls(*a, **k))
        return build.build_gpt_model(cfg, tc, acc.capabilities(), True, True, layout.pg_collection).eval()


@pytest.mark.parametrize("scaling", [False, True], ids=["rope", "llama3-scaled-rope"])
@torch.no_grad()
def test_rope_follows_position_ids(cpu, scaling: bool) -> None:
    from megatron.core.models.gpt import GPTModel

    from loong.llm.models.gpt import LoongGPTModel, rotary_freqs_from_positions

    model, stock = _model(cpu, llama3_scaling=scaling), _model(cpu, GPTModel, llama3_scaling=scaling)
    assert type(model) is LoongGPTModel and type(stock) is GPTModel
    stock.load_state_dict(model.state_dict())
    assert torch.equal(model.rotary_pos_emb.inv_freq, stock.rotary_pos_emb.inv_freq)
    tokens = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(1))
    arange = torch.arange(96).expand(2, -1)
    assert torch.equal(model(tokens, arange, None), stock(tokens, arange, None))  # bit-identical pretraining
    # per-sample frequencies: sample 1 starts at 40, as megatron's own table with an offset
    freqs = rotary_freqs_from_positions(model.rotary_pos_emb, torch.stack([arange[0], arange[0] + 40]))
    assert freqs.shape == (96, 2, 1, 16)
    assert torch.equal(freqs[:, 0], model.rotary_pos_emb.get_emb(96)[:, 0])
    assert torch.equal(freqs[:, 1], model.rotary_pos_emb.get_emb(96, offset=40)[:, 0])
    restart = torch.cat([torch.arange(50), torch.arange(46)]).expand(2, -1)
    assert not torch.allclose(model(tokens, restart, None), stock(tokens, restart, None))  # positions are used


def _per_document_losses(model, data: PackedSequences, document_mask: bool = True) -> torch.Tensor:
    """[documents, 2]: each document's summed assistant-token loss and its token count."""
    out = torch.zeros(len(data.docs), 2, dtype=torch.float64)
    for i in range(len(data)):
        sample = data[i]
        batch = make_sft_microbatch([sample], document_mask=document_mask)
        with torch.no_grad():
            losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        for k, d in enumerate(data.bins[i]):
            sel = torch.from_numpy(sample["doc_ids"] == k)[None] * batch["loss_mask"]
            out[d] = torch.stack([(losses.double() * sel).sum(), sel.sum().double()])
    return out


def test_packed_loss_equals_unpacked_loss(cpu, tok) -> None:
    """THE oracle: packing changes nothing but speed — per-document loss sums and counts agree."""
    model = _model(cpu)
    template = resolve_template("qwen", tok.hf)
    convs, _ = read_conversations(packaged_chat_path())
    docs, _ = fit_documents([encode_conversation(tok.hf, template, c.messages) for c in convs[:16]], 256)
    packed = PackedSequences(docs, 256, packing=True, pad_id=tok.eod_id)
    unpacked = PackedSequences(docs, 256, packing=False, pad_id=tok.eod_id)
    assert len(packed) < len(unpacked) == 16 and max(len(b) for b in packed.bins) >= 2
    p, u = _per_document_losses(model, packed), _per_document_losses(model, unpacked)
    assert torch.equal(p[:, 1], u[:, 1])  # the same assistant tokens
    assert ((p[:, 0] / p[:, 1] - u[:, 0] / u[:, 1]).abs().max() <= 1e-5)
    assert abs(p[:, 0].sum() / p[:, 1].sum() - u[:, 0].sum() / u[:, 1].sum()) <= 1e-5
    # without the document mask, packed conversations attend to one another: the losses differ
    leaky = _per_document_losses(model, packed, document_mask=False)
    assert (leaky[:, 0] / leaky[:, 1] - u[:, 0] / u[:, 1]).abs().max() > 1e-3


class _SequenceSquares(TorchDispatchMode):
    """Records every tensor an op creates that has two dimensions of the sequence length (an [s, s] mask or
    score matrix)."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.seq, self.seen = seq, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and list(t.shape).count(self.seq) >= 2:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_packed_4096_tokens_run_without_a_dense_mask(cpu) -> None:
    """One 4096-token row of 40 packed documents: neither the micro-batch nor any op of the model's forward makes
    an [s, s] tensor, and every document's token losses equal that document run alone with plain causal attention."""
    seq = 4096
    model = _model(cpu)
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 180, size=40)
    assert lengths.sum() < seq  # one row, padding at its end
    docs = [Document(rng.integers(0, 512, n + 1), np.ones(n, dtype=bool)) for n in lengths]
    packed = PackedSequences(docs, seq, packing=True, pad_id=0)
    assert len(packed) == 1 and len(packed.bins[0]) == 40
    watch = _SequenceSquares(seq)
    with torch.no_grad(), watch:
        batch = make_sft_microbatch([packed[0]])
        losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        # the watch sees what a dense document mask would be
        ids = batch["attention_mask"]
        _ = ids[:, :, None] == ids[:, None, :]
    assert watch.seen == [("aten.eq.Tensor", (1, seq, seq))]
    assert batch["attention_mask"].shape == (1, seq) and all(t.numel() <= seq for t in batch.values())
    # each document alone: a batch of one document a row (padded after it), no mask, megatron's causal SDPA
    longest = int(lengths.max())
    tokens = torch.zeros(40, longest, dtype=torch.long)
    labels = torch.zeros(40, longest, dtype=torch.long)
    for k, d in enumerate(packed.bins[0]):
        n = int(lengths[d])
        tokens[k, :n] = torch.from_numpy(docs[d].ids[:-1])
        labels[k, :n] = torch.from_numpy(docs[d].ids[1:])
    with torch.no_grad():
        alone = model(tokens, torch.arange(longest).expand(40, -1), None, labels=labels)
    doc_ids = batch["attention_mask"][0]
    for k, d in enumerate(packed.bins[0]):
        n = int(lengths[d])
        assert torch.allclose(losses[0, doc_ids == k], alone[k, :n], atol=1e-5), k


def test_sft_task_data_is_deterministic(cpu, tmp_path: Path) -> None:
    from loong.core.config import compose_config
    from loong.core.registry import TASKS
    from loong.llm.schema import LLMRunConfig
    from loong.llm.sft.task import SFTTask

    assert TASKS.get("sft") is TASKS.get("llm.sft") is SFTTask
    assert TASKS.get("pretrain") is TASKS.get("llm.pretrain")
    cfg, _ = compose_config("loong.llm.configs", "pretrain",
                            ["task=sft", "train.seq_length=256", "train.global_batch_size=4",
                             "train.micro_batch_size=2"], LLMRunConfig)  # fmt: skip
    acc, layout = cpu
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        a, b = SFTTask(cfg, acc, layout), SFTTask(cfg, acc, layout)
        a.setup_data()
        b.setup_data()
    line = err.getvalue().splitlines()[0]
    assert line.startswith("sft data: chat_example.jsonl: 50 conversations used (48 train, 2 valid")
    assert "0 truncated, 0 dropped, 0 skipped lines; template qwen" in line and "packing efficiency" in line
    batches = list(a.train_microbatches(3, 2))
    assert len(batches) == 2 and batches[0]["attention_mask"].shape == (2, 256)  # document ids, no [s, s] mask
    # the reported loss is scaled so that the engine's mean over micro-batches is the per-token mean
    tokens = sum(float(x["loss_mask"].sum()) for x in batches)
    assert tokens * float(batches[0]["loss_scale"]) == pytest.approx(2, rel=1e-6)
    for x, y in zip(batches, b.train_microbatches(3, 2), strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert not torch.equal(batches[0]["tokens"], next(a.train_microbatches(4, 2))["tokens"])
    cfg.data.packing = False
    c = SFTTask(cfg, acc, layout)
    with contextlib.redirect_stderr(io.StringIO()):
        c.setup_data()
    assert len(c.train_data) == 48 > len(a.train_data) and c.train_data.efficiency < a.train_data.efficiency


# --- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_sft_end_to_end(tmp_path: Path) -> None:
    """``loong-llm train task=sft`` on a generated mixed-format chat file: loss falls, a checkpoint
    is written, and the saved tokenizer carries the chat template it was trained with."""
    from transformers import AutoTokenizer

    from loong.llm.cli import main

    rows = []
    for i, conv in enumerate(read_conversations(packaged_chat_path())[0]):
        msgs = [m for m in conv.messages if m["role"] != "system"][:2]
        if i % 3 == 1:
            rows.append({"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]],
                                            "value": m["content"]} for m in msgs]})  # fmt: skip
        elif i % 3 == 2:
            rows.append({"instruction": msgs[0]["content"], "output": msgs[1]["content"]})
        else:
            rows.append({"messages": msgs})
    data = _jsonl(tmp_path / "chat.jsonl", [*rows, "{broken"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["train", "task=sft", f"data.path={data}", "data.on_error=skip", "train.seq_length=256",
                   "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=24", "train.warmup_steps=2",
                   "train.eval_interval=12", "train.eval_iters=1", "train.progress=false", f"output_dir={tmp_path}",
                   "run_name=sft"])  # fmt: skip
    sys.stderr.write(err.getvalue())
    assert rc == 0, err.getvalue()[-3000:]
    assert "50 conversations used" in err.getvalue() and "1 skipped lines (invalid JSON: 1)" in err.getvalue()
    run = tmp_path / "sft"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses) == 24 and sum(losses[-4:]) / 4 < 0.8 * losses[0], losses  # measured 6.29 -> 3.97
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [12, 24] and evals[24] < evals[12], evals
    step = run / "checkpoints" / "step_00000024"
    assert (run / "checkpoints" / "latest").read_text().strip() == step.name and any(step.glob("*.distcp"))
    assert AutoTokenizer.from_pretrained(step / "tokenizer").chat_template == QWEN_TEMPLATE
