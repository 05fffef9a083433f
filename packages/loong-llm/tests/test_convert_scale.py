"""``loong-llm convert`` at scale, on a tiny model: sharded safetensors in and out, ``--max-shard-size``,
``--dtype bf16``, and ``--verify`` (passes on a good conversion, exit 2 naming the tensor on a tampered one).

All cases go through the CLI's ``main`` in-process, from one HF folder of the ``tiny_llama_hf`` fixture.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loong.llm.cli import main
from loong.llm.hf_io import INDEX, parse_size

pytestmark = pytest.mark.slow


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        rc = main(["convert", *argv, "--no-progress"])
    except SystemExit as exc:  # argparse errors
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


def _hf_state(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


@pytest.fixture(scope="module")
def chain(tiny_llama_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """HF (one file) -> Loong -> HF in 60 kB shards -> Loong (from the shards) -> HF, each step verified."""
    root = tmp_path_factory.mktemp("convert_scale")
    paths = {"hf": tiny_llama_hf, "loong": root / "loong", "sharded": root / "sharded",
             "loong2": root / "loong2", "back": root / "back"}
    for a, b, extra in (("hf", "loong", []), ("loong", "sharded", ["--max-shard-size", "60kB"]),
                        ("sharded", "loong2", []), ("loong2", "back", [])):
        assert main(["convert", str(paths[a]), str(paths[b]), "--verify", "--no-progress", *extra]) == 0, (a, b)
    return paths


def test_max_shard_size_writes_shards_and_an_index(chain: dict[str, Path]) -> None:
    sharded = chain["sharded"]
    index = json.loads((sharded / INDEX).read_text())
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    n = len(shards)
    assert n >= 4 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    for shard in shards:  # each shard is at most the limit, unless it holds a single larger tensor
        tensors = load_file(sharded / shard)
        assert set(tensors) == {k for k, v in index["weight_map"].items() if v == shard}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 60_000 or len(tensors) == 1, (shard, size, len(tensors))
    state = _hf_state(sharded)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert not (chain["back"] / INDEX).exists() and (chain["back"] / "model.safetensors").is_file()


def test_sharded_round_trip_is_bit_exact(chain: dict[str, Path]) -> None:
    orig = load_file(chain["hf"] / "model.safetensors")
    for name in ("sharded", "back"):
        again = _hf_state(chain[name])
        assert set(again) == set(orig), name
        for key, tensor in orig.items():
            assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), (name, key)


def test_verify_reports_a_summary(chain: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, err = _cli(capsys, str(chain["loong"]), str(tmp_path / "hf"), "--verify")
    n_tensors = len(load_file(chain["hf"] / "model.safetensors"))
    assert rc == 0 and f"verify: {n_tensors} tensors, 213,568 parameters match bit for bit" in err, err


def test_verify_fails_on_a_tampered_hf_folder(chain: dict[str, Path], tmp_path: Path) -> None:
    from loong.llm.convert import VerifyError, verify

    bad = tmp_path / "tampered"
    shutil.copytree(chain["sharded"], bad)
    weight_map = json.loads((bad / INDEX).read_text())["weight_map"]
    name = "model.layers.2.self_attn.k_proj.weight"
    shard = bad / weight_map[name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] += 1.0
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(VerifyError, match=rf"verify: {name} \(native decoder.layers.self_attention.linear_qkv."
                                          rf"weight\) differs .*1 of 2048 elements differ, first at \[3, 5\]"):
        verify(bad, chain["loong"], "hf")


def test_verify_exits_2_after_a_bad_write(chain: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A conversion whose output is corrupted as it is written: --verify exits 2 with the first tensor."""
    from loong.llm import hf_io

    real_add = hf_io.ShardWriter.add

    def corrupting_add(self: hf_io.ShardWriter, key: str, tensor: torch.Tensor) -> None:
        if key == "model.layers.1.mlp.up_proj.weight":
            tensor = tensor.clone()
            tensor.view(-1)[7] = 0.5
        real_add(self, key, tensor)

    monkeypatch.setattr(hf_io.ShardWriter, "add", corrupting_add)
    rc, err = _cli(capsys, str(chain["loong"]), str(tmp_path / "hf"), "--verify")
    assert rc == 2, err
    line = [ln for ln in err.splitlines() if "verify" in ln]
    assert line and "model.layers.1.mlp.up_proj.weight (native decoder.layers.mlp.linear_fc1.weight) differs" in \
        line[0] and "first at [0, 7]" in line[0] and "Traceback" not in err, err


def test_verify_fails_on_a_missing_and_an_extra_tensor(chain: dict[str, Path], tmp_path: Path) -> None:
    from loong.llm.convert import VerifyError, verify

    state = load_file(chain["back"] / "model.safetensors")
    for what, change in (("no tensor model.norm.weight", lambda s: s.pop("model.norm.weight")),
                         ("has 1 tensors the checkpoint does not", lambda s: s.update(extra=torch.zeros(2)))):
        folder = tmp_path / what.split()[1]
        shutil.copytree(chain["back"], folder)
        changed = dict(state)
        change(changed)
        save_file(changed, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(VerifyError, match=what):
            verify(folder, chain["loong"], "hf")


def test_dtype_bf16_both_ways_with_verify(chain: dict[str, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype bf16 writes bf16 and --verify compares after casting the source to it (fp32 -> bf16 rounds)."""
    from loong.core.checkpoint import resolve_checkpoint
    from loong.llm.convert import CheckpointTensors

    rc, err = _cli(capsys, str(chain["sharded"]), str(tmp_path / "loong16"), "--dtype", "bf16", "--verify")
    assert rc == 0 and "match bit for bit" in err, err
    reader = CheckpointTensors(resolve_checkpoint(tmp_path / "loong16"))
    emb = reader.get("embedding.word_embeddings.weight")
    orig = load_file(chain["hf"] / "model.safetensors")
    assert emb.dtype == torch.bfloat16 and torch.equal(emb, orig["model.embed_tokens.weight"].to(torch.bfloat16))

    rc, err = _cli(capsys, str(chain["loong"]), str(tmp_path / "hf16"), "--dtype", "bf16", "--verify",
                   "--max-shard-size", "0.1MB")
    assert rc == 0 and "match bit for bit (HF bfloat16 / Loong float32)" in err, err
    out = _hf_state(tmp_path / "hf16")
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for key, tensor in orig.items():
        assert out[key].dtype == torch.bfloat16 and torch.equal(out[key], tensor.to(torch.bfloat16)), key
    # auto keeps the source's dtype: the bf16 folder becomes a bf16 checkpoint
    rc, err = _cli(capsys, str(tmp_path / "hf16"), str(tmp_path / "loong16b"), "--verify")
    assert rc == 0, err
    reader = CheckpointTensors(resolve_checkpoint(tmp_path / "loong16b"))
    assert reader.meta["decoder.layers.mlp.linear_fc1.weight"][1] == torch.bfloat16


def test_bad_max_shard_size_exits_2_and_writes_nothing(chain: dict[str, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("5XB", "-1GB", "0", "big"):
        rc, err = _cli(capsys, str(chain["loong"]), str(tmp_path / "out"), f"--max-shard-size={bad}")
        assert rc == 2 and f"max shard size {bad!r} is not a positive size" in err, (bad, err)
        assert not (tmp_path / "out").exists()
    assert (parse_size("5GB"), parse_size("500MB"), parse_size("2GiB"), parse_size("1000")) == (
        5 * 10**9, 500 * 10**6, 2 * 2**30, 1000)
