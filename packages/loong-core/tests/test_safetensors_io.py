"""The shared safetensors shard writer and reader (``loong.core.checkpoint.safetensors_io``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loong.core.checkpoint.safetensors_io import LazyTensors, SafetensorsFolder, ShardWriter, convert_dtype
from loong.core.errors import LoongError


def test_tied_tensors_added_one_by_one_are_written_each_with_its_own_storage(tmp_path: Path) -> None:
    """An MTP layer's embedding and head are the model's own tensors: safetensors refuses a file whose tensors
    share memory, so the writer copies a storage it has already queued for the same shard."""
    embed, head = torch.randn(8, 4), torch.randn(8, 4)
    writer = ShardWriter(tmp_path, max_shard_bytes=10_000)
    for key, tensor in (("embed", embed), ("head", head), ("mtp.embed", embed), ("mtp.head", head),
                        ("view", embed[2:])):
        writer.add(key, tensor)
    assert writer.close() == ["model.safetensors"]
    back = load_file(tmp_path / "model.safetensors")
    assert set(back) == {"embed", "head", "mtp.embed", "mtp.head", "view"}
    for key, want in (("embed", embed), ("mtp.embed", embed), ("head", head), ("mtp.head", head),
                      ("view", embed[2:])):
        assert torch.equal(back[key], want), key


def test_a_shard_boundary_splits_and_indexes(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.full((16,), float(i)) for i in range(5)}  # 64 bytes each
    writer = ShardWriter(tmp_path, max_shard_bytes=130)  # two a shard
    for key, tensor in tensors.items():
        writer.add(key, tensor)
    names = writer.close()
    assert names == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    back = {k: v for name in names for k, v in load_file(tmp_path / name).items()}
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    assert (tmp_path / "model.safetensors.index.json").is_file()


def test_convert_dtype_auto_keeps_the_sources_most_common_float_dtype() -> None:
    """``--dtype auto``: the source's own dtype (integer tensors do not count; float32 without floats); a named
    dtype wins; a dtype no model is built in, or an unknown name, is one clear error."""
    bf16, fp32, i64 = torch.bfloat16, torch.float32, torch.int64
    assert convert_dtype("auto", [bf16, bf16, fp32, i64, i64, i64], "src") == bf16
    assert convert_dtype("auto", [fp32, torch.float16, torch.float16], "src") == torch.float16
    assert convert_dtype("auto", [i64], "src") == fp32
    assert convert_dtype("fp16", [bf16], "src") == torch.float16 and convert_dtype("fp32", [bf16], "src") == fp32
    with pytest.raises(LoongError, match="^src: its weights are float64, which --dtype auto cannot keep; pass"):
        convert_dtype("auto", [torch.float64], "src")
    with pytest.raises(LoongError, match="^--dtype fp8: one of auto, bf16, fp32, fp16$"):
        convert_dtype("fp8", [bf16], "src")


def test_lazy_tensors_read_a_tensor_only_when_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LazyTensors`` lists every name without reading, reads (and casts) exactly the tensor asked for, and gives
    meta tensors of the saved shapes and dtypes."""
    tensors = {"a": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int64), "c": torch.randn(5)}
    writer = ShardWriter(tmp_path, max_shard_bytes=40)  # shards: the reader follows the index
    for key, tensor in tensors.items():
        writer.add(key, tensor)
    writer.close()
    folder = SafetensorsFolder(tmp_path)
    reads: list[str] = []
    get = folder.get
    monkeypatch.setattr(folder, "get", lambda key: reads.append(key) or get(key))
    lazy = LazyTensors(folder, cast=lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
    assert list(lazy) == ["a", "b", "c"] and len(lazy) == 3 and "b" in lazy and "z" not in lazy
    meta = lazy.meta()
    assert {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in meta.items()} == {
        "a": ((3, 2), torch.float32, "meta"), "b": ((4,), torch.int64, "meta"), "c": ((5,), torch.float32, "meta")}
    assert reads == []
    assert torch.equal(lazy["c"], tensors["c"].to(torch.bfloat16)) and lazy["c"].dtype == torch.bfloat16
    assert torch.equal(lazy["b"], tensors["b"]) and lazy["b"].dtype == torch.int64
    assert reads == ["c", "c", "b", "b"]
    with pytest.raises(KeyError):
        lazy["z"]


def test_write_safetensors_writes_one_file_asking_for_one_tensor_at_a_time(tmp_path: Path) -> None:
    """``write_safetensors``: safetensors' own reader loads the file (every dtype, a scalar, an empty tensor, a
    view); the file is open under a temporary name before the first tensor is asked for, each tensor is asked for once, in the
    entries' order, and a tensor that does not match its header fails naming it, leaving no file."""
    from safetensors import safe_open

    from loong.core.checkpoint.safetensors_io import write_safetensors

    base = torch.randn(6, 5)
    tensors = {"b.view": base[1:3], "a.f32": torch.randn(3, 4), "bf16": torch.randn(7).bfloat16(),
               "ids": torch.arange(5), "mask": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 3), "f16": torch.randn(2, 2).half()}
    asked: list[str] = []
    path = tmp_path / "model.safetensors"
    tmp = tmp_path / ".model.safetensors.tmp"

    def get(name: str) -> torch.Tensor:
        if not asked:  # the file is being written from the shapes alone before any tensor is asked for
            assert tmp.is_file() and not path.exists()
        asked.append(name)
        return tensors[name]

    nbytes = write_safetensors(path, {k: (v.shape, v.dtype) for k, v in tensors.items()}, get)
    assert asked == list(tensors) and nbytes == sum(v.numel() * v.element_size() for v in tensors.values())
    back = load_file(path)
    assert set(back) == set(tensors)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with pytest.raises(LoongError, match=r"other\.safetensors: tensor x came as \[2, 3\] torch.float32, its header "
                                         r"says \[3, 2\]"):
        write_safetensors(tmp_path / "other.safetensors", {"x": ((3, 2), torch.float32)},
                          lambda name: torch.zeros(2, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
