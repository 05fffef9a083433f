"""``loong-diffusion convert --max-shard-size/--verify`` (issue 25): a Loong checkpoint written as diffusers shards
with their index loads in diffusers and converts back bit for bit, ``--verify`` passes both ways, and a tampered
output fails ``--verify`` with exit 2 naming the tensor."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from loong.core.checkpoint import safetensors_io
from loong.diffusion.cli import main
from loong.diffusion.models.wan import WanTransformer, save_diffusers, to_diffusers, wan_preset
from loong.diffusion.models.wan.mapping import INDEX_NAME, WEIGHTS_NAME, read_diffusers_folder


def _main(*argv: str | Path) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Wan as a single-file diffusers folder, random fp32 weights."""
    torch.manual_seed(0)
    model = WanTransformer(wan_preset("tiny"))
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    return save_diffusers(state, wan_preset("tiny"), tmp_path_factory.mktemp("wan") / "tiny")


def test_sharded_round_trip_with_verify(tmp_path: Path, folder: Path) -> None:
    rc, log = _main("convert", folder, tmp_path / "loong", "--dtype", "bf16", "--verify", "--no-progress")
    assert rc == 0, log
    _, want = read_diffusers_folder(folder)
    assert f"verify: {len(want)} tensors, {sum(v.numel() for v in want.values()):,} parameters match bit for bit " \
           "(Loong bfloat16 / diffusers float32)" in log
    rc, log = _main("convert", tmp_path / "loong", tmp_path / "shards", "--max-shard-size", "100KB", "--verify",
                    "--no-progress")
    assert rc == 0, log
    assert "verify: " in log and "(diffusers bfloat16 / Loong bfloat16)" in log
    shards = sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors"))
    index = json.loads((tmp_path / "shards" / INDEX_NAME).read_text())
    assert len(shards) > 1 and not (tmp_path / "shards" / WEIGHTS_NAME).exists()
    assert shards == [f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)]
    assert sorted(index["weight_map"]) == sorted(want) and set(index["weight_map"].values()) == set(shards)
    assert all(p.stat().st_size <= 100_000 + 10_000 for p in (tmp_path / "shards").glob("*.safetensors"))
    _, got = read_diffusers_folder(tmp_path / "shards")
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != torch.bfloat16 or not torch.equal(got[k], want[k].bfloat16())] == []
    # diffusers itself reads the sharded folder, and a sharded folder converts again (reading it lazily)
    from diffusers import WanTransformer3DModel

    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "shards", torch_dtype=torch.bfloat16).state_dict()
    assert [k for k in got if not torch.equal(loaded[k], got[k])] == []
    rc, log = _main("convert", tmp_path / "shards", tmp_path / "again", "--verify", "--no-progress")
    assert rc == 0 and "(Loong bfloat16 / diffusers bfloat16)" in log, log
    # a second export into the same folder leaves no stale shard behind
    rc, log = _main("convert", tmp_path / "loong", tmp_path / "shards", "--no-progress")
    assert rc == 0, log
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["config.json", WEIGHTS_NAME]


def test_verify_fails_on_a_tampered_output(tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, log = _main("convert", folder, tmp_path / "loong", "--no-progress")
    assert rc == 0, log
    name = sorted(to_diffusers(WanTransformer(wan_preset("tiny")).state_dict()))[7]
    real_add = safetensors_io.ShardWriter.add

    def corrupting_add(self: safetensors_io.ShardWriter, key: str, tensor: torch.Tensor) -> None:
        if key == name:
            tensor = tensor.clone()
            tensor.view(-1)[3] += 1
        real_add(self, key, tensor)

    monkeypatch.setattr(safetensors_io.ShardWriter, "add", corrupting_add)
    rc, log = _main("convert", tmp_path / "loong", tmp_path / "bad", "--verify", "--no-progress")
    assert rc == 2
    assert f"verify: {name} differs between {tmp_path / 'bad'} and " in log
    assert "1 of " in log and "elements differ, first at " in log
    # the other direction: a diffusers tensor changed after the import is found too
    monkeypatch.setattr(safetensors_io.ShardWriter, "add", real_add)
    from loong.diffusion.convert import verify

    state = dict(read_diffusers_folder(folder)[1])
    state[name] = state[name].clone()
    state[name].view(-1)[0] = -state[name].view(-1)[0]
    safetensors_io.write_shards(tmp_path / "tampered", state.items(), 10**9, stem="diffusion_pytorch_model")
    with pytest.raises(safetensors_io.VerifyError, match=rf"verify: {name} differs between "):
        verify(tmp_path / "tampered", tmp_path / "loong", "loong")


def test_bad_max_shard_size_exits_2_and_writes_nothing(tmp_path: Path, folder: Path) -> None:
    rc, log = _main("convert", folder, tmp_path / "out", "--max-shard-size", "lots")
    assert rc == 2 and "max shard size 'lots' is not a positive size" in log
    assert not (tmp_path / "out").exists()


def test_loong_to_diffusers_streams_one_tensor_at_a_time(tmp_path: Path, folder: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Loong -> diffusers reads one checkpoint tensor per read and writes it before the next is read (a converter
    that loads the whole model first would read them all, or all before the first write)."""
    from loong.diffusion import convert as conv

    assert _main("convert", folder, tmp_path / "loong", "--no-progress")[0] == 0
    events: list[tuple[str, int]] = []
    read, add = conv._read, safetensors_io.ShardWriter.add

    def one_read(plan: object, keys: list[str]) -> dict[str, torch.Tensor]:
        events.append(("read", len(keys)))
        return read(plan, keys)  # type: ignore[arg-type]

    def logged_add(self: safetensors_io.ShardWriter, key: str, tensor: torch.Tensor) -> None:
        events.append(("add", 1))
        add(self, key, tensor)

    monkeypatch.setattr(conv, "_read", one_read)
    monkeypatch.setattr(safetensors_io.ShardWriter, "add", logged_add)
    rc, log = _main("convert", tmp_path / "loong", tmp_path / "out", "--no-progress")
    assert rc == 0, log
    reads = [n for kind, n in events if kind == "read"]
    assert len(reads) == len(WanTransformer(wan_preset("tiny")).state_dict()) and set(reads) == {1}
    assert events[1] == ("add", 1)  # the first tensor is written before the second is read


def test_diffusers_to_loong_never_loads_the_folder_whole(tmp_path: Path, folder: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers -> Loong reads the folder a tensor (a fused group) at a time, casting as it reads: a whole-folder
    read fails the test, and no source tensor is read twice."""
    def whole(self: safetensors_io.SafetensorsFolder) -> dict[str, torch.Tensor]:
        raise AssertionError("the diffusers folder was loaded whole")

    reads: list[str] = []
    get = safetensors_io.SafetensorsFolder.get
    monkeypatch.setattr(safetensors_io.SafetensorsFolder, "load_all", whole)
    monkeypatch.setattr(safetensors_io.SafetensorsFolder, "get", lambda self, key: reads.append(key) or get(self, key))
    rc, log = _main("convert", folder, tmp_path / "loong", "--dtype", "bf16", "--no-progress")
    assert rc == 0, log
    want = to_diffusers(WanTransformer(wan_preset("tiny")).state_dict())
    assert sorted(reads) == sorted(want)
