"""``loong-llm convert`` streams for DeepSeek-V3/V3.2 and with ``--merge-lora`` (issue 25).

DeepSeek's per-key mapping (``models/deepseek_v3/mapping.py``) names exactly the native tensors a built Loong model
holds, and HF -> native -> HF one key at a time reads each HF tensor once and gives the folder back bit for bit
(fp32 and bf16). The converter reads one native tensor at a time from the checkpoint and writes its HF tensors
before the next is read, and HF -> Loong reads each HF tensor once; megatron's whole-checkpoint read and the
whole-folder readers are never called (they raise here). ``--merge-lora`` reads each weight's adapters with it and
writes the same bytes as merging the whole state dict.

Tiny random folders: ``test_deepseek_v3``'s (1 dense + 2 MoE layers, one MTP module with the embedding / head
copies DeepSeek releases), ``test_deepseek_v32``'s (the lightning indexers), the conftest's LLaMA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from loong.core.checkpoint import resolve_checkpoint, safetensors_io
from loong.core.errors import LoongError
from loong.llm import hf as llm_hf
from loong.llm import hf_io
from loong.llm.cli import main
from loong.llm.convert import CheckpointTensors, verify
from loong.llm.hf import model_config_from_hf
from loong.llm.hf_io import read_hf_folder
from loong.llm.models.deepseek_v3.mapping import hf_aliases
from loong.llm.models.hf_mapping import (
    hf_to_native,
    hf_to_native_key,
    native_shapes,
    native_to_hf,
    native_to_hf_key,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_deepseek_v3 import build_tiny_deepseek_v3_hf  # noqa: E402  (same folder: the tiny models of those tests)
from test_deepseek_v32 import _hf_model as build_tiny_v32  # noqa: E402
from test_lora import _model, _random_adapters, _world  # noqa: E402

pytestmark = pytest.mark.slow
FAMILIES = ["deepseek_v3", "deepseek_v32"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream_hf")
    build_tiny_v32(root / "deepseek_v32")
    return {"deepseek_v3": build_tiny_deepseek_v3_hf(root / "deepseek_v3"), "deepseek_v32": root / "deepseek_v32"}


@pytest.mark.parametrize("family", FAMILIES)
def test_per_key_mapping_covers_the_model_and_round_trips(folders: dict[str, Path], family: str) -> None:
    from loong.core.engines.megatron.state import sharded_tensors

    cfg = model_config_from_hf(folders[family])
    assert cfg.family == family and cfg.is_mla
    _, state = read_hf_folder(folders[family])
    with _world() as world:  # the native layout: what megatron's model holds, not what the mapping says
        held = {st.key: tuple(st.global_shape) for st in sharded_tensors([_model(world, cfg)])
                if not st.key.endswith("_extra_state")}
    assert native_shapes(cfg) == held
    if family == "deepseek_v3":
        assert cfg.mtp_num_layers == 1 and hf_aliases(cfg) == {"model.layers.3.embed_tokens.weight",
                                                               "model.layers.3.shared_head.head.weight"}
    else:
        assert any(".indexer." in k for k in held)
    for dtype in (torch.float32, torch.bfloat16):
        typed = {k: v.to(dtype) for k, v in state.items()}
        reads: list[str] = []

        def take(name: str, typed: dict[str, torch.Tensor] = typed, reads: list[str] = reads) -> torch.Tensor:
            reads.append(name)
            return typed[name]

        native = {key: hf_to_native_key(key, take, cfg) for key in native_shapes(cfg)}
        assert sorted(reads) == sorted(set(typed) - hf_aliases(cfg))  # each once; the MTP copies never
        back: dict[str, torch.Tensor] = {}
        for key, tensor in native.items():
            assert tensor.dtype == dtype and tuple(tensor.shape) == native_shapes(cfg)[key], key
            own = native_to_hf_key(key, tensor, cfg)
            assert not set(own) & set(back), key
            back.update(own)
        assert sorted(back) == sorted(typed)
        assert [k for k in typed if not torch.equal(back[k], typed[k])] == []
        # the whole-state functions are the same mapping key by key
        whole = hf_to_native(typed, cfg)
        assert list(whole) == list(native) and all(torch.equal(whole[k], native[k]) for k in native)
        again = native_to_hf(whole, cfg)
        assert list(again) == list(back) and all(torch.equal(again[k], back[k]) for k in back)


def test_per_key_mapping_errors_name_the_tensors(folders: dict[str, Path]) -> None:
    cfg = model_config_from_hf(folders["deepseek_v3"])
    _, state = read_hf_folder(folders["deepseek_v3"])
    fc1 = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
    odd = {**state, "model.layers.1.mlp.experts.5.up_proj.weight": torch.zeros(31, 64)}
    with pytest.raises(LoongError, match=r"linear_fc1.*experts\.5\.up_proj\.weight \(31, 64\)"):
        hf_to_native_key(fc1, odd.__getitem__, cfg)
    with pytest.raises(LoongError, match="no tensor model.layers.2.self_attn.kv_b_proj.weight"):
        hf_to_native({k: v for k, v in state.items() if k != "model.layers.2.self_attn.kv_b_proj.weight"}, cfg)
    with pytest.raises(LoongError, match=r"model.layers.4.input_layernorm.weight.*num_nextn_predict_layers"):
        hf_to_native({**state, "model.layers.4.input_layernorm.weight": torch.ones(64)}, cfg)
    with pytest.raises(LoongError, match="no native tensor decoder.layers.3.input_layernorm.weight"):
        native_to_hf_key("decoder.layers.3.input_layernorm.weight", torch.ones(64), cfg)
    with pytest.raises(LoongError, match=f"{fc1} has shape \\(8, 62, 64\\), the config implies \\(8, 64, 64\\)"):
        native_to_hf_key(fc1, torch.ones(8, 62, 64), cfg)


def _log_reads(monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, str]]) -> None:
    """Log every checkpoint tensor read, HF tensor read and shard-writer add as ``(kind, name)``; the whole-side
    readers fail."""
    from megatron.core.dist_checkpointing import serialization

    def whole(*args: object, **kwargs: object) -> None:
        raise AssertionError("the converter read a whole side")

    for owner, name in ((serialization, "load_plain_tensors"), (hf_io, "read_hf_folder"), (llm_hf, "read_hf_folder"),
                        (safetensors_io.SafetensorsFolder, "load_all")):
        monkeypatch.setattr(owner, name, whole)
    logged = {"native": (CheckpointTensors, "get"), "hf": (safetensors_io.SafetensorsFolder, "get"),
              "add": (hf_io.ShardWriter, "add")}
    for kind, (owner, name) in logged.items():
        def log(self: object, key: str, *args: object, _kind: str = kind, _method: object = getattr(owner, name)
                ) -> object:
            events.append((_kind, key))
            return _method(self, key, *args)  # type: ignore[operator]

        monkeypatch.setattr(owner, name, log)


def _groups(events: list[tuple[str, str]]) -> list[tuple[str, list[str], list[str]]]:
    """(native key read, the checkpoint tensors read with it, the HF tensors added before the next read): a read
    of an adapter (``lora_``) belongs to the weight read before it."""
    groups: list[tuple[str, list[str], list[str]]] = []
    for kind, name in events:
        if kind == "native" and "lora_" in name:
            assert not groups[-1][2], f"{name} read after its weight's HF tensors were written"
            groups[-1][1].append(name)
        elif kind == "native":
            groups.append((name, [], []))
        elif kind == "add":
            groups[-1][2].append(name)
    return groups


def _assert_streamed_export(events: list[tuple[str, str]], step: Path, keys: list[str]) -> list[tuple]:
    """Each native key read once, in order, its HF tensors (all of them) written before the next read."""
    assert [key for key, _, _ in _groups(events)] == keys
    from loong.llm.checkpoint_init import checkpoint_model_config

    cfg = checkpoint_model_config(step, key=None)
    reader = CheckpointTensors(step)
    for key, _, added in _groups(events):
        meta = torch.empty(native_shapes(cfg)[key], dtype=reader.meta[key][1], device="meta")
        assert added == list(native_to_hf_key(key, meta, cfg)), key
    return _groups(events)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_streams_both_ways(folders: dict[str, Path], family: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    folder = folders[family]
    cfg = model_config_from_hf(folder)
    _, state = read_hf_folder(folder)
    events: list[tuple[str, str]] = []
    _log_reads(monkeypatch, events)

    assert main(["convert", str(folder), str(tmp_path / "loong"), "--no-progress"]) == 0
    assert sorted(k for kind, k in events if kind == "hf") == sorted(set(state) - hf_aliases(cfg))
    assert not any(kind == "add" for kind, _ in events)

    events.clear()
    assert main(["convert", str(tmp_path / "loong"), str(tmp_path / "back"), "--no-progress",
                 "--max-shard-size", "200kB"]) == 0
    _assert_streamed_export(events, resolve_checkpoint(tmp_path / "loong"), list(native_shapes(cfg)))
    back = hf_io.HFTensors(tmp_path / "back")
    assert len({back.file_of(k) for k in back.keys()}) > 1  # sharded as it went
    assert sorted(back.keys()) == sorted(state)
    assert [k for k in state if not torch.equal(back.get(k), state[k])] == []

    for into, hf, ckpt in (("hf", tmp_path / "back", tmp_path / "loong"), ("loong", folder, tmp_path / "loong")):
        events.clear()
        assert "match bit for bit" in verify(hf, ckpt, into)
        assert [k for kind, k in events if kind == "native"] == list(native_shapes(cfg)), into
        assert sorted(k for kind, k in events if kind == "hf") == sorted(state), into


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_llama_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A weights-only Loong checkpoint of the tiny LLaMA with random rank-4 adapters on every target, and the HF
    tensors of its whole merged state (megatron's whole read, ``merge_lora``, ``native_to_hf``: the reference)."""
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    from loong.core.checkpoint import CheckpointManager
    from loong.core.config.schema import to_dict
    from loong.llm.convert import _WeightsOnly
    from loong.llm.hf import load_hf_into
    from loong.llm.lora import adapter_shapes, apply_lora, load_adapter_state, merge_lora
    from loong.llm.models.config import LoraConfig
    from loong.llm.schema import LLMRunConfig

    out = tmp_path_factory.mktemp("lora_ckpt")
    cfg = model_config_from_hf(tiny_llama_hf)
    cfg.lora = LoraConfig(rank=4, alpha=8.0)
    with _world() as world:
        model = _model(world, cfg)
        load_hf_into([model], tiny_llama_hf, cfg)
        apply_lora([model], cfg.lora)
        load_adapter_state([model], _random_adapters(adapter_shapes([model])))
        run_cfg = LLMRunConfig(model=cfg, run_name="lora", output_dir=str(out))
        CheckpointManager(out / "checkpoints").save(0, _WeightsOnly(model), {"step": 0, "weights_only": True},
                                                    to_dict(run_cfg))
        plain = load_plain_tensors(str(resolve_checkpoint(out / "checkpoints")))
    wanted = native_shapes(cfg)
    merged = merge_lora({k: v for k, v in plain.items() if not k.startswith("optimizer.")}, cfg.lora)
    reference = {k: v.clone() for k, v in native_to_hf({k: merged[k] for k in wanted}, cfg).items()}
    return out / "checkpoints", reference


def test_merge_lora_streams(lora_checkpoint: tuple[Path, dict], tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, reference = lora_checkpoint
    step = resolve_checkpoint(ckpt)
    events: list[tuple[str, str]] = []
    _log_reads(monkeypatch, events)
    assert main(["convert", str(ckpt), str(tmp_path / "hf"), "--merge-lora", "--no-progress"]) == 0
    from loong.llm.checkpoint_init import checkpoint_model_config

    cfg = checkpoint_model_config(step, key=None)
    groups = _assert_streamed_export(events, step, list(native_shapes(cfg)))
    with_adapters = {key: sorted(read) for key, read, _ in groups if read}
    stems = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert sorted(with_adapters) == sorted(k for k in native_shapes(cfg) if k.endswith(tuple(f"{s}.weight"
                                                                                              for s in stems)))
    for key, read in with_adapters.items():
        stem = key.removesuffix(".weight")
        assert read == [stem + ".lora_A.weight", stem + ".lora_B.weight"], key
    back = hf_io.HFTensors(tmp_path / "hf")
    assert sorted(back.keys()) == sorted(reference)
    assert [k for k in reference if not torch.equal(back.get(k), reference[k])] == []
    events.clear()
    assert "match bit for bit" in verify(tmp_path / "hf", ckpt, "hf", merge_lora=True)
    assert sorted(k for kind, k in events if kind == "hf") == sorted(reference)


def test_merge_lora_refuses_an_adapter_without_its_pair(lora_checkpoint: tuple[Path, dict], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, _ = lora_checkpoint
    meta = CheckpointTensors(resolve_checkpoint(ckpt)).meta
    lone = next(k for k in meta if k.endswith("linear_proj.lora_B.weight"))
    init = CheckpointTensors.__init__

    def without_a(self: CheckpointTensors, step_dir: Path) -> None:
        init(self, step_dir)
        del self.meta[lone.replace("lora_B", "lora_A")]

    monkeypatch.setattr(CheckpointTensors, "__init__", without_a)
    with pytest.raises(LoongError, match=f"{lone} has no matching .*lora_A.weight"):
        from loong.llm.convert import loong_to_hf

        loong_to_hf(ckpt, tmp_path / "hf", merge_lora=True)
    assert not (tmp_path / "hf").exists()
