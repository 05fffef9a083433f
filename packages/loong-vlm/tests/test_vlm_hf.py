"""Whole VLMs against transformers: the oracle of the assembled model, and the Hugging Face round trips.

For each family (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, InternVL) a tiny random ``*ForConditionalGeneration`` is built
in-process (fp32, CPU, no downloads) and saved with the tiny processor beside it. The task itself
(``model.init_from_hf`` in ``check_config`` and ``init_weights``, its data path: plan, pack, decode, collate) builds
Loong's :class:`~loong.vlm.models.vlm.VisionLanguageModel` from that folder; on one packed row of two conversations
with several images of different sizes (and, for the Qwen families, a video), its logits and per-token losses equal
transformers' on the same conversations (max relative error <= 1e-5), transformers computing its own position ids
and visual features from the processor's tensors. Then: HF -> Loong -> HF is bit-exact in both file layouts; a
Loong export loads with ``from_pretrained`` and predicts the same; ``loong-vlm convert`` both ways through the CLI;
``loong-vlm train model.init_from_hf=... train.save_hf=true`` and ``train.resume=<converted>`` start from the same
weights.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from test_vlm_data import _png, _video  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.config import compose_config  # noqa: E402
from loong.core.engines.megatron.layout import world  # noqa: E402
from loong.core.engines.megatron.state import gather_full_state  # noqa: E402
from loong.core.errors import LoongError  # noqa: E402
from loong.llm.hf_io import read_hf_folder  # noqa: E402
from loong.vlm.cli import main  # noqa: E402
from loong.vlm.data.dataset import vision_loader  # noqa: E402
from loong.vlm.data.processors import build_tiny_processor  # noqa: E402
from loong.vlm.hf import (  # noqa: E402
    HFLayout,
    canonical_layout,
    export_model,
    hf_to_native,
    layout_of,
    native_shapes,
    native_to_hf,
)
from loong.vlm.hf_config import VLMParts, hf_config_of, parts_from_hf  # noqa: E402
from loong.vlm.schema import VLMRunConfig  # noqa: E402
from loong.vlm.task import MEDIA_KEYS, VLMTask  # noqa: E402

TOL = 1e-5
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl")
#: the tiny processor family and geometry of each VLM family
PROCESSORS = {"qwen2_5_vl": ("qwen2_5_vl", {"patch_size": 14}), "qwen3_vl": ("qwen3_vl", {"patch_size": 16}),
              "qwen3_vl_moe": ("qwen3_vl", {"patch_size": 16}),
              "internvl": ("internvl", {"patch_size": 14, "image_size": 56, "max_tiles": 4})}
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=640, rms_norm_eps=1e-6, max_position_embeddings=2048)
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, spatial_merge_size=2,
                   temporal_patch_size=2)
SEQ = 1024  # both conversations of a family fit one packed row


# --- the HF side ---------------------------------------------------------------------------------------
def _token_ids(processor: Any) -> dict[str, int]:
    tok = processor.tokenizer
    if type(processor).__name__ == "InternVLProcessor":
        return {"image_token_id": tok.convert_tokens_to_ids("<IMG_CONTEXT>")}
    return {f"{n}_token_id": tok.convert_tokens_to_ids(f"<|{n}{'_pad' if n in ('image', 'video') else ''}|>")
            for n in ("image", "video", "vision_start", "vision_end")}


def hf_config(family: str, processor: Any):  # noqa: ANN201
    """A tiny transformers config of ``family``, the placeholder ids those of ``processor``'s tokenizer."""
    from transformers import InternVLConfig, Qwen2_5_VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    ids = _token_ids(processor)
    if family == "qwen2_5_vl":  # windows of 2x2 merged patches, full attention in block 1; tied embeddings
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        # tokens_per_second: neither HF's default (4) nor Loong's (2), so the video's positions show it is read
        vision = dict(QWEN_VISION, patch_size=14, window_size=56, fullatt_block_indexes=[1], tokens_per_second=3)
        return Qwen2_5_VLConfig(text_config=dict(TEXT, rope_parameters=rope), vision_config=vision,
                                tie_word_embeddings=True, **ids)
    if family in ("qwen3_vl", "qwen3_vl_moe"):  # DeepStack from block 0 into decoder layer 0
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        vision = dict(QWEN_VISION, patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0])
        text = dict(TEXT, head_dim=16, rope_parameters=rope)
        if family == "qwen3_vl":
            return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        moe = dict(text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
        return Qwen3VLMoeConfig(text_config=moe, vision_config=vision, tie_word_embeddings=False, **ids)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=[56, 56],
                  patch_size=[14, 14], attention_bias=True)
    text = dict(TEXT, model_type="qwen3", head_dim=16)
    return InternVLConfig(vision_config=vision, text_config=text, image_seq_length=4, downsample_ratio=0.5,
                          tie_word_embeddings=False, **ids)  # untied: the saved lm_head has its own legacy name


@torch.no_grad()
def hf_model(family: str, processor: Any, seed: int = 2):  # noqa: ANN201
    """``family``'s ForConditionalGeneration with random weights (norms around 1), fp32, eager attention."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(hf_config(family, processor), dtype=torch.float32,
                                                    attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.05 * noise)
    return model.eval()


def _conversations(assets: Path, video: bool) -> list[dict]:
    """Two conversations: three images of different sizes (and a video), then two more images."""
    first = [{"type": "text", "text": "Compare "}, {"type": "image", "image": str(assets / "wide.png")},
             {"type": "text", "text": " with "}, {"type": "image", "image": str(assets / "big.png")},
             {"type": "text", "text": " and "}, {"type": "image", "image": str(assets / "tall.png")}]
    if video:
        first += [{"type": "text", "text": " then the clip "}, {"type": "video", "video": str(assets / "clip.mp4")}]
    second = [{"type": "image", "image": str(assets / "small.png")}, {"type": "text", "text": "What now? "},
              {"type": "image", "image": str(assets / "wide.png")}]
    def reply(text: str) -> dict:
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}

    return [{"messages": [{"role": "user", "content": first}, reply("A wide one, then a tall one.")]},
            {"messages": [{"role": "user", "content": second}, reply("Noise, twice.")]}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    _png(d / "wide.png", 90, 60, 0)
    _png(d / "tall.png", 50, 120, 1)
    _png(d / "small.png", 40, 40, 2)
    _png(d / "big.png", 200, 150, 3)
    _video(d / "clip.mp4")
    return d


@pytest.fixture(scope="module")
def processors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny processor folder per processor family."""
    root = tmp_path_factory.mktemp("processors")
    return {name: build_tiny_processor(root / name, name, **shape) for name, shape in
            dict(PROCESSORS.values()).items()}


@pytest.fixture(scope="module")
def cases(assets: Path, processors: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per family: the HF model, its folder (save_pretrained + the processor), the conversations JSONL."""
    from transformers import AutoProcessor

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        processor = AutoProcessor.from_pretrained(str(processors[PROCESSORS[family][0]]), local_files_only=True)
        model = hf_model(family, processor)
        folder = root / family
        model.save_pretrained(str(folder))
        processor.save_pretrained(str(folder))
        data = root / f"{family}.jsonl"
        data.write_text("".join(json.dumps(c) + "\n" for c in _conversations(assets, family != "internvl")))
        out[family] = {"hf": model, "folder": folder, "data": data, "processor": processor}
    return out


# --- the Loong side -------------------------------------------------------------------------------------
def _config(overrides: list[str]) -> VLMRunConfig:
    cfg, _ = compose_config("loong.vlm.configs", "train", overrides, VLMRunConfig)
    return cfg


def _task_overrides(case: dict, out: Path) -> list[str]:
    return [f"model.init_from_hf={case['folder']}", f"data.path={case['data']}", "data.valid_fraction=0",
            f"train.seq_length={SEQ}", "train.global_batch_size=1", "train.micro_batch_size=1", f"output_dir={out}"]


def _hf_inputs(task: VLMTask, batch: dict, samples: list) -> dict[str, torch.Tensor]:
    """transformers' inputs for the row's conversations, one a batch row (right-padded): the processor's token
    ids and media tensors (the row's, which are the conversations' in order)."""
    n = max(len(s) - 1 for s in samples)
    ids = torch.full((len(samples), n), task.processor.pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), n, dtype=torch.long)
    types = torch.zeros(len(samples), n, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s) - 1] = torch.from_numpy(s.input_ids[:-1])
        mask[i, : len(s) - 1] = 1
        types[i, : len(s) - 1] = torch.from_numpy(s.mm_token_type_ids[:-1].astype("int64"))
    out = {"input_ids": ids, "attention_mask": mask}
    if task.processor.is_qwen:
        out["mm_token_type_ids"] = types
        out.update({k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
                    if k in batch and batch[k].shape[0]})
        if task.processor.family == "qwen2_5_vl" and "video_grid_thw" in out:
            out["second_per_grid_ts"] = torch.cat([torch.from_numpy(s.second_per_grid_ts) for s in samples])
    else:
        out["pixel_values"] = batch["pixel_values"]
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max relative error of ``a`` against ``b``."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=FAMILIES)
def run(request: pytest.FixtureRequest, cases: dict[str, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The task's model of one family's folder on one packed row, transformers' on the same conversations, and the
    task's export of its model."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    family = request.param
    case = cases[family]
    out = tmp_path_factory.mktemp(f"run_{family}")
    cfg = _config(_task_overrides(case, out))
    VLMTask.check_config(cfg)
    acc = select_accelerator("cpu")
    with world(acc) as layout, torch.no_grad():
        model_parallel_cuda_manual_seed(0)
        task = VLMTask(cfg, acc, layout)
        task.setup_data()
        model = task.build_model(task.model_config(torch.float32), True, True, None)
        task.init_weights([model])
        model.eval()
        packed = task.data.train.packed
        assert len(packed) == 1 and len(packed.bins[0]) == 2, "both conversations in one row"
        batch = next(iter(vision_loader(task.data.train, [[0]])))
        batch.pop("skipped_samples")
        media = {k: batch[k] for k in MEDIA_KEYS if k in batch}
        logits = model(batch["tokens"], batch["position_ids"], batch["document_ids"], **media)
        step = dict(batch, loss_scale=torch.tensor(1.0))
        losses, loss_fn = task.forward_step(iter([step]), model)
        loss_sum, count, _ = loss_fn(losses)
        flip = {k: -v if k.startswith("pixel_values") else v for k, v in media.items()}
        flipped = model(batch["tokens"], batch["position_ids"], batch["document_ids"], **flip)
        exported = export_model([model], VLMParts.of(task.cfg), out / "export", task.processor)
        state = gather_full_state([model])
    samples = [packed.samples[k] for k in packed.bins[0]]
    inputs = _hf_inputs(task, batch, samples)
    with torch.no_grad():
        ref = case["hf"](**inputs).logits
    return {"family": family, "case": case, "cfg": task.cfg, "batch": batch, "samples": samples, "inputs": inputs,
            "logits": logits, "losses": losses, "loss": (loss_sum / count).item(), "flipped": flipped, "ref": ref,
            "exported": exported, "state": state}


def _segments(r: dict) -> list[tuple[int, int]]:
    """``(start, length)`` of each conversation in the packed row."""
    starts, at = [], 0
    for s in r["samples"]:
        starts.append((at, len(s) - 1))
        at += len(s) - 1
    return starts


# --- the oracle ------------------------------------------------------------------------------------------
def test_logits_and_loss_match_transformers(run: dict) -> None:
    batch, ref = run["batch"], run["ref"]
    if run["family"] == "internvl":  # tiles of five images of four sizes: 1 to 4 tiles (+ a thumbnail) each
        assert batch["pixel_values"].dim() == 4 and batch["pixel_values"].shape[0] > 5
    else:  # five images of four sizes (five grids, four distinct) and a video
        grids = batch["image_grid_thw"].tolist()
        assert len(grids) == 5 and len({tuple(g) for g in grids}) == 4 and batch["video_grid_thw"].shape[0] == 1
    kinds = set(batch["mm_token_type_ids"].unique().tolist())
    assert kinds == ({0, 1, 2} if run["family"] != "internvl" else {0, 1})  # text, images (, a video)
    num, den = 0.0, 0.0
    for i, (start, n) in enumerate(_segments(run)):
        got = run["logits"][0, start:start + n]
        want = ref[i, :n]
        assert got.shape == want.shape and rel(got, want) <= TOL, (i, rel(got, want))
        labels = batch["labels"][0, start:start + n]
        ref_losses = F.cross_entropy(want, labels, reduction="none")
        assert rel(run["losses"][0, start:start + n], ref_losses) <= TOL
        mask = batch["loss_mask"][0, start:start + n]
        assert mask.sum() > 0
        num += float((ref_losses * mask).sum())
        den += float(mask.sum())
    assert abs(run["loss"] / (num / den) - 1) <= TOL
    # the comparison sees the vision side: other pixels give other logits
    start, n = _segments(run)[0]
    assert rel(run["flipped"][0, start:start + n], ref[0, :n]) > 1e-3


# --- the HF mapping ------------------------------------------------------------------------------------
def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:4]
    for key, tensor in a.items():
        assert b[key].dtype == tensor.dtype and torch.equal(b[key], tensor), key


def test_hf_to_loong_to_hf_is_bit_exact(run: dict) -> None:
    """In memory (transformers' state dict) and as saved (the folder's files): every tensor back as it was, and
    the native state is exactly the task's model's (every key, every value)."""
    family, case = run["family"], run["case"]
    parts = VLMParts.of(run["cfg"])
    memory = case["hf"].state_dict()
    _, saved = read_hf_folder(case["folder"])
    if parts.foundation.tie_word_embeddings:  # transformers' state dict lists the tied alias; files do not
        memory = {k: v for k, v in memory.items() if k != "lm_head.weight"}
    for state in (memory, saved):
        _assert_same(state, native_to_hf(hf_to_native(state, parts), parts, layout_of(state, parts)))
    native = hf_to_native(saved, parts)
    assert set(native) == set(run["state"])
    for key, tensor in native.items():
        assert torch.equal(run["state"][key], tensor), key
    shapes = native_shapes(parts)
    assert shapes == {k: tuple(v.shape) for k, v in run["state"].items()}
    # what Loong writes is what transformers saves (Qwen3-VL-MoE: the published experts layout instead)
    want = canonical_layout(family)
    if family == "qwen3_vl_moe":
        assert layout_of(saved, parts) == HFLayout(False, "transformers5") and want == HFLayout(False, "hub")
    else:
        assert layout_of(saved, parts) == want
        assert want.legacy == (family in ("qwen2_5_vl", "internvl"))


def test_export_loads_in_transformers(run: dict) -> None:
    """``Task.export``: a folder ``from_pretrained`` loads as the family's class, every tensor the original's,
    the config (token ids from the processor) read back as the same four configs, the same predictions."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    case, folder = run["case"], run["exported"]
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    assert type(model) is type(case["hf"])
    _assert_same(case["hf"].state_dict(), model.state_dict())
    config = json.loads((folder / "config.json").read_text())
    for key, value in _token_ids(case["processor"]).items():
        assert config[key] == value == getattr(model.config, key), key
    tok = case["processor"].tokenizer
    assert (config["text_config"]["eos_token_id"], config["text_config"]["pad_token_id"]) == (tok.eos_token_id,
                                                                                             tok.pad_token_id)
    back, ours = parts_from_hf(config, preset=run["cfg"].model.preset), VLMParts.of(run["cfg"])
    assert back.model == dataclasses.replace(ours.model, init_from_hf=None)  # the run's own field, not the folder's
    assert back.encoder == ours.encoder and back.projector == ours.projector
    assert back.foundation == dataclasses.replace(ours.foundation, extra=back.foundation.extra)
    assert type(AutoProcessor.from_pretrained(str(folder), local_files_only=True)) is type(case["processor"])
    with torch.no_grad():
        logits = model.eval()(**run["inputs"]).logits
    for i, (start, n) in enumerate(_segments(run)):
        assert rel(logits[i, :n], run["logits"][0, start:start + n]) <= TOL


# --- convert, train ------------------------------------------------------------------------------------
TRAIN = ["train.steps=2", "train.warmup_steps=0", "train.eval_interval=0", "train.eval_iters=0",
         "train.progress=false"]


def _checkpoint_dtypes(ckpt: Path) -> dict[str, torch.dtype]:
    """The saved dtype of every model tensor of a Loong checkpoint (from its DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from loong.core.checkpoint import resolve_checkpoint

    meta = FileSystemReader(str(resolve_checkpoint(ckpt))).read_metadata().state_dict_metadata
    return {k: v.properties.dtype for k, v in meta.items()
            if isinstance(v, TensorStorageMetadata) and not k.endswith("_extra_state")}


def _first_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in records if "train_loss" in r]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_convert_both_ways_through_the_cli(cases: dict, family: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    """HF folder -> weights-only Loong checkpoint (with the processor) -> HF folder: the same files' tensors, bit
    for bit (both families' published layout is the legacy one transformers saves)."""
    from loong.core.checkpoint import read_config, read_state, resolve_checkpoint

    case = cases[family]
    loong, back = tmp_path / "loong", tmp_path / "back"
    assert main(["convert", str(case["folder"]), str(loong)]) == 0
    step = resolve_checkpoint(loong)
    assert read_state(step)["weights_only"] is True and read_config(step)["model"]["family"] == family
    assert (step / "processor" / "tokenizer.json").is_file()
    assert main(["convert", str(loong), str(back)]) == 0
    _, orig = read_hf_folder(case["folder"])
    _, again = read_hf_folder(back)
    _assert_same(orig, again)
    assert json.loads((back / "config.json").read_text())["architectures"] == [type(case["hf"]).__name__]
    capsys.readouterr()
    assert main(["convert", str(case["folder"]), str(tmp_path / "x"), "--processor", str(case["folder"])]) == 2
    assert "--processor applies to a Loong checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_convert_shards_and_verifies(cases: dict, family: str, tmp_path: Path, capsys: pytest.CaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``--max-shard-size`` writes numbered shards with their index, ``--verify`` passes both ways (legacy names;
    Qwen3-VL-MoE's fused experts) after a ``--dtype`` cast, and a tampered write fails it with exit 2 naming the
    tensor."""
    from loong.core.checkpoint import safetensors_io
    from loong.llm.hf_io import INDEX

    case = cases[family]
    loong, back = tmp_path / "loong", tmp_path / "back"
    _, orig = read_hf_folder(case["folder"])
    assert main(["convert", str(case["folder"]), str(loong), "--dtype", "bf16", "--verify", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"verify: {len(orig)} tensors, " in err and "(Loong bfloat16 / HF float32" in err, err
    assert main(["convert", str(loong), str(back), "--max-shard-size", "200KB", "--verify", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"verify: {len(orig)} tensors, " in err and "(HF bfloat16 / Loong bfloat16" in err, err
    shards = sorted(p.name for p in back.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(json.loads((back / INDEX).read_text())["weight_map"].values()) == set(shards)
    _, again = read_hf_folder(back)
    # through the mapping: Qwen3-VL-MoE is written in the published expert form, not transformers 5's it was read in
    from loong.vlm.hf import parts_from_folder

    parts = parts_from_folder(case["folder"])
    _assert_same({k: v.bfloat16() for k, v in hf_to_native(orig, parts).items()}, hf_to_native(again, parts))
    # --dtype auto keeps the source's dtype both ways (as loong-llm's): the bf16 folder becomes a bf16 checkpoint
    assert main(["convert", str(back), str(tmp_path / "loong16"), "--verify", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"verify: {len(orig)} tensors, " in err and "(Loong bfloat16 / HF bfloat16" in err, err
    saved = _checkpoint_dtypes(tmp_path / "loong16")
    # every weight in bf16 but the foundation's norms, which megatron keeps in fp32 on CPU (exact: bf16 upcast)
    assert saved["foundation.embedding.word_embeddings.weight"] == torch.bfloat16, saved
    assert {k for k, d in saved.items() if d != torch.bfloat16} <= {k for k in saved if "norm" in k}, saved
    assert all(d == torch.bfloat16 for k, d in saved.items() if k.startswith(("encoder.", "projector."))), saved
    name = sorted(again)[5]
    real_add = safetensors_io.ShardWriter.add

    def corrupting_add(self: safetensors_io.ShardWriter, key: str, tensor: torch.Tensor) -> None:
        if key == name:
            tensor = tensor.clone()
            tensor.view(-1)[1] += 1
        real_add(self, key, tensor)

    monkeypatch.setattr(safetensors_io.ShardWriter, "add", corrupting_add)
    assert main(["convert", str(loong), str(tmp_path / "bad"), "--verify", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"verify: {name} differs between {tmp_path / 'bad'} and " in err and "elements differ, first at" in err


def test_train_from_hf_exports_and_a_converted_checkpoint_resumes_alike(cases: dict, tmp_path: Path) -> None:
    """``model.init_from_hf`` + ``train.save_hf`` (its export loads in transformers and equals the final checkpoint
    converted), and ``train.resume`` of the same folder converted: the two runs start from the same weights and
    log the same losses."""
    from transformers import AutoModelForImageTextToText

    case = cases["qwen3_vl"]
    base = [*TRAIN, f"data.path={case['data']}", "data.valid_fraction=0", f"train.seq_length={SEQ}",
            "train.global_batch_size=1", "train.micro_batch_size=1", f"output_dir={tmp_path}"]
    assert main(["train", *base, "run_name=init", f"model.init_from_hf={case['folder']}", "train.save_hf=true"]) == 0
    exported = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "init" / "hf"), dtype=torch.float32)
    assert type(exported) is type(case["hf"])
    key = "model.visual.blocks.0.attn.qkv.weight"
    assert not torch.equal(exported.state_dict()[key], case["hf"].state_dict()[key])  # trained, encoder included
    assert main(["convert", str(tmp_path / "init"), str(tmp_path / "final")]) == 0
    _assert_same(read_hf_folder(tmp_path / "init" / "hf")[1], read_hf_folder(tmp_path / "final")[1])
    assert main(["convert", str(case["folder"]), str(tmp_path / "converted")]) == 0
    assert main(["train", *base, "run_name=resumed", f"train.resume={tmp_path / 'converted'}"]) == 0
    init, resumed = _first_losses(tmp_path / "init"), _first_losses(tmp_path / "resumed")
    assert len(init) == 2 and init == pytest.approx(resumed, rel=1e-6)
    assert init[1] < init[0]  # it trains


def test_custom_family_refuses_hf_io(cases: dict) -> None:
    folder = cases["qwen2_5_vl"]["folder"]
    with pytest.raises(LoongError, match="model.family=custom"):
        VLMTask.check_config(_config(["model.family=custom", f"model.init_from_hf={folder}"]))
    with pytest.raises(LoongError, match="model.family=custom.*train.save_hf"):
        VLMTask.check_config(_config(["model.family=custom", "train.save_hf=true"]))


def test_bad_inputs_are_named(cases: dict, run: dict) -> None:
    """A state missing a tensor, one mixing the two layouts, a processor of another family: each refused with
    what is wrong."""
    parts = VLMParts.of(run["cfg"])
    _, saved = read_hf_folder(run["case"]["folder"])
    key = next(k for k in saved if "layers.1." in k)
    with pytest.raises(LoongError, match="missing|no tensor"):
        hf_to_native({k: v for k, v in saved.items() if k != key}, parts)
    if canonical_layout(run["family"]).legacy:
        memory = run["case"]["hf"].state_dict()
        mixed = dict(saved, **{k: v for k, v in memory.items() if "layers.0." in k})
        with pytest.raises(LoongError, match="mixes two tensor layouts"):
            hf_to_native(mixed, parts)
    other = cases["internvl" if run["family"] != "internvl" else "qwen2_5_vl"]["processor"]
    with pytest.raises(LoongError, match="takes a processor of class"):
        hf_config_of(parts, other)


#: Qwen2.5-VL-3B-Instruct's published config.json (the flat, transformers-4.4x form)
QWEN2_5_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000, "max_window_layers": 70,
    "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}


def test_a_published_config_reads_as_its_preset() -> None:
    """Qwen2.5-VL-3B's config.json gives exactly the ``model=qwen2_5_vl_3b`` preset's shapes (all four sections)."""
    preset = VLMParts.of(_config(["model=qwen2_5_vl_3b"]))
    got = parts_from_hf(QWEN2_5_VL_3B, keep=preset, preset="qwen2_5_vl_3b")
    assert got.model == preset.model and got.encoder == preset.encoder and got.projector == preset.projector
    assert got.foundation == dataclasses.replace(preset.foundation, extra=got.foundation.extra)
    assert got.foundation.extra == {"hf": {"bos_token_id": 151643, "eos_token_id": 151645}}
