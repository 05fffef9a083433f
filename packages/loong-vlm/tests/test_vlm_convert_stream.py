"""``loong-vlm convert`` streams (issue 25): the per-key mapping the converter streams with is the whole-state mapping,
key by key, for every family and both file layouts; Loong -> HF reads one native tensor at a time from the
checkpoint and writes its HF tensors before the next is read (megatron's whole-checkpoint read is never called);
HF -> Loong reads each HF tensor once, never the folder whole; ``--verify`` reads each side tensor by tensor, each
tensor once.

The tiny random ``*ForConditionalGeneration`` folders are test_vlm_hf's (fp32, CPU, no downloads).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_vlm_hf import FAMILIES, PROCESSORS, hf_model  # noqa: E402

from loong.core.checkpoint import resolve_checkpoint, safetensors_io  # noqa: E402
from loong.llm.convert import CheckpointTensors  # noqa: E402
from loong.llm.hf_io import read_hf_folder  # noqa: E402
from loong.vlm import convert as vlm_convert  # noqa: E402
from loong.vlm import hf as vlm_hf  # noqa: E402
from loong.vlm.cli import main  # noqa: E402
from loong.vlm.hf import (  # noqa: E402
    KeyMapping,
    canonical_layout,
    hf_to_native,
    layout_of,
    native_to_hf,
    parts_from_folder,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny HF folder (save_pretrained, the processor beside it)."""
    from transformers import AutoProcessor

    from loong.vlm.data.processors import build_tiny_processor

    root = tmp_path_factory.mktemp("stream_hf")
    out = {}
    for family in FAMILIES:
        name, shape = PROCESSORS[family]
        proc_dir = root / f"processor_{family}"
        processor = AutoProcessor.from_pretrained(str(build_tiny_processor(proc_dir, name, **shape)),
                                                  local_files_only=True)
        out[family] = root / family
        hf_model(family, processor).save_pretrained(str(out[family]))
        processor.save_pretrained(str(out[family]))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_key_mapping_is_the_whole_mapping_key_by_key(folders: dict[str, Path], family: str) -> None:
    """HF -> native one key (a stacked foundation key: one layer) at a time, and native -> HF one key at a time,
    give exactly the whole-state mapping's tensors, in the folder's layout and in the canonical one."""
    parts = parts_from_folder(folders[family])
    _, saved = read_hf_folder(folders[family])
    layout = layout_of(saved, parts)
    whole = hf_to_native(saved, parts)
    mapping = KeyMapping(parts, layout)
    assert sorted(mapping.shapes) == sorted(whole)
    asked: list[str] = []

    def take(name: str) -> torch.Tensor:
        asked.append(name)
        return saved[name]

    for key, shape in mapping.shapes.items():
        if mapping.is_stacked(key):
            got = torch.stack([mapping.to_native(key, take, layer) for layer in range(shape[0])])
        else:
            got = mapping.to_native(key, take)
        assert got.dtype == whole[key].dtype and torch.equal(got, whole[key]), key
    # every HF tensor is asked for, none twice (Qwen3-VL-MoE: a layer's fused experts once for all its experts)
    assert sorted(asked) == sorted(saved)
    for lay in {layout, canonical_layout(family)}:
        want = native_to_hf(whole, parts, lay)
        got = {}
        for key in mapping.shapes:
            pieces = KeyMapping(parts, lay).to_hf(key, whole[key])
            assert not set(pieces) & set(got), key
            got.update(pieces)
        assert sorted(got) == sorted(want), lay
        assert [n for n in want if not torch.equal(got[n], want[n])] == [], lay


def _log_reads(monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, str]]) -> None:
    """Log every checkpoint tensor read, HF tensor read and shard-writer add; the whole-model readers fail."""
    from megatron.core.dist_checkpointing import serialization

    ckpt_get, hf_get, add = CheckpointTensors.get, safetensors_io.SafetensorsFolder.get, safetensors_io.ShardWriter.add

    def whole(*args: object, **kwargs: object) -> None:
        raise AssertionError("a converter read a whole side")

    def logged_ckpt(self: CheckpointTensors, key: str) -> torch.Tensor:
        events.append(("native", key))
        return ckpt_get(self, key)

    def logged_hf(self: safetensors_io.SafetensorsFolder, key: str) -> torch.Tensor:
        events.append(("hf", key))
        return hf_get(self, key)

    def logged_add(self: safetensors_io.ShardWriter, key: str, tensor: torch.Tensor) -> None:
        events.append(("add", key))
        add(self, key, tensor)

    monkeypatch.setattr(serialization, "load_plain_tensors", whole)
    monkeypatch.setattr(vlm_hf, "read_hf_folder", whole)
    monkeypatch.setattr(safetensors_io.SafetensorsFolder, "load_all", whole)
    monkeypatch.setattr(CheckpointTensors, "get", logged_ckpt)
    monkeypatch.setattr(safetensors_io.SafetensorsFolder, "get", logged_hf)
    monkeypatch.setattr(safetensors_io.ShardWriter, "add", logged_add)


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "internvl"])
def test_convert_streams_both_ways(folders: dict[str, Path], family: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-VL-MoE (fused experts, fused QKV / gate-up in the foundation) and InternVL (fused q/k/v in the
    vision tower, legacy names): HF -> Loong reads each HF tensor once; Loong -> HF reads each native tensor once,
    in order, and adds exactly its HF tensors to the shard writer before reading the next; ``--verify`` reads
    both sides tensor by tensor, each once. A converter that loads a side whole fails (megatron's
    ``load_plain_tensors``, ``read_hf_folder`` and ``load_all`` raise)."""
    folder = folders[family]
    parts = parts_from_folder(folder)
    hf_names = sorted(read_hf_folder(folder)[1])
    mapping = KeyMapping(parts, canonical_layout(family))
    events: list[tuple[str, str]] = []
    _log_reads(monkeypatch, events)

    assert main(["convert", str(folder), str(tmp_path / "loong"), "--no-progress"]) == 0
    assert sorted(k for kind, k in events if kind == "hf") == hf_names and not any(e[0] == "add" for e in events)

    events.clear()
    assert main(["convert", str(tmp_path / "loong"), str(tmp_path / "back"), "--no-progress"]) == 0
    assert [k for kind, k in events if kind == "native"] == list(mapping.shapes)  # each once, in order
    # after each read, its own HF tensors, all of them, go to the writer before the next read
    step, groups = resolve_checkpoint(tmp_path / "loong"), []
    for kind, name in events:
        if kind == "native":
            groups.append((name, []))
        elif kind == "add":
            groups[-1][1].append(name)
    reader = CheckpointTensors(step)
    for key, added in groups:
        meta = torch.empty(mapping.shapes[key], dtype=reader.meta[key][1], device="meta")
        assert added == list(mapping.to_hf(key, meta)), key
    assert sorted(name for _, added in groups for name in added) == hf_names

    for into, src, dst in (("hf", tmp_path / "back", tmp_path / "loong"), ("loong", folder, tmp_path / "loong")):
        events.clear()
        assert "match bit for bit" in vlm_convert.verify(src, dst, into)
        assert [k for kind, k in events if kind == "native"] == list(mapping.shapes), into
        assert sorted(k for kind, k in events if kind == "hf") == hf_names, into
