"""Resumable preprocess output: after a Ctrl-C, a crash, or a failed shard write (disk full), a rerun continues
where the last committed shard stopped and ends with exactly the clips of an uninterrupted run (no duplicates, no
corrupt shard); a rerun with other options or an edited manifest is refused; appended rows are added."""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import pytest
import torch
from preprocess_testing import read_folder, run_cli, write_image, write_manifest, write_video
from tiny_components import tiny_text_encoder_folder, tiny_vae_folder

from loong.core.errors import LoongError
from loong.diffusion.preprocess import encode, preprocess, writer

ROWS = 6
BUCKETS = "5x32x32,1x32x32"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("resume")
    rows = []
    for i in range(ROWS):
        if i % 3 == 2:
            rows.append({"image": write_image(d / f"{i}.png", 36, 40, seed=i).name, "caption": f"a cat {i}"})
        else:
            rows.append({"video": write_video(d / f"{i}.mp4", 6, 32, 36, seed=i).name, "caption": f"a car {i}"})
    paths = {"root": d, "vae": tiny_vae_folder(d / "vae"), "text": tiny_text_encoder_folder(d / "text"),
             "manifest": write_manifest(d / "m.jsonl", rows)}
    paths["reference"] = d / "reference"
    _run(paths, paths["reference"])
    return paths


def _run(s: dict[str, Path], out: Path, manifest: Path | None = None, buckets: str = BUCKETS) -> dict:
    return preprocess(manifest or s["manifest"], out, vae=s["vae"], text_encoder=s["text"], buckets=buckets,
                      shard_size=2, progress=False)


def _assert_same_clips(got: Path, want: Path) -> None:
    a, b = read_folder(got), read_folder(want)
    assert [c["line"] for c in a] == [c["line"] for c in b] == list(range(1, ROWS + 1))  # each row once
    for x, y in zip(a, b, strict=True):
        assert x["bucket"] == y["bucket"] and x["caption"] == y["caption"]
        assert torch.equal(x["latents"], y["latents"]) and torch.equal(x["text"], y["text"])
    assert json.loads((got / "index.json").read_text())["complete"]


def _fail_on_call(monkeypatch: pytest.MonkeyPatch, n: int, exc: BaseException) -> None:
    """Make the n-th VAE encode of this test raise ``exc`` (a Ctrl-C or a crash in the middle of a row)."""
    original, calls = encode.Encoders.encode_video, [0]

    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return original(self, pixels)

    monkeypatch.setattr(encode.Encoders, "encode_video", encode_video)


def test_ctrl_c_keeps_finished_rows_and_a_rerun_completes(setup: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    _fail_on_call(monkeypatch, 4, KeyboardInterrupt())
    rc, log = run_cli("preprocess", str(setup["manifest"]), "-o", str(out), "--vae", str(setup["vae"]),
                      "--text-encoder", str(setup["text"]), "--buckets", BUCKETS, "--shard-size", "2",
                      "--no-progress")
    assert rc == 130 and "interrupted" in log, log
    index = json.loads((out / "index.json").read_text())
    assert not index["complete"] and (index["lines"], index["clips"]) == (3, 3)  # rows 1-2, then row 3 on Ctrl-C
    monkeypatch.undo()
    summary = _run(setup, out)
    assert (summary["resumed_at"], summary["new_clips"]) == (3, 3)
    _assert_same_clips(out, setup["reference"])


def test_crash_loses_only_the_open_shard(setup: dict[str, Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    _fail_on_call(monkeypatch, 4, RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(RuntimeError, match="illegal memory"):
        _run(setup, out)
    assert json.loads((out / "index.json").read_text())["lines"] == 2  # row 3 was not committed
    monkeypatch.undo()
    assert _run(setup, out)["resumed_at"] == 2
    _assert_same_clips(out, setup["reference"])


def test_failed_shard_write_leaves_no_partial_shard(setup: dict[str, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    original, calls = writer.save_file, [0]

    def disk_full(tensors: dict, filename: str, metadata: dict) -> None:
        calls[0] += 1
        if calls[0] == 2:  # the second shard: half written, then the disk is full
            original(tensors, filename, metadata=metadata)
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        original(tensors, filename, metadata=metadata)

    monkeypatch.setattr(writer, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        _run(setup, out)
    monkeypatch.undo()
    names = sorted(p.name for p in out.iterdir())
    assert "shard-00001.safetensors" not in names and "shard-00001.json" not in names
    assert not [n for n in names if n.endswith(".tmp")]
    # what a SIGKILL in the middle of a write leaves: an orphan temporary file and a shard without its sidecar
    (out / ".shard-00001.safetensors.4242.tmp").write_bytes(b"partial")
    (out / "shard-00001.safetensors").write_bytes(b"garbage")
    _run(setup, out)
    assert not list(out.glob(".*.tmp"))
    _assert_same_clips(out, setup["reference"])


def test_complete_rerun_adds_nothing_and_appended_rows_are_added(setup: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(setup["reference"], out)
    assert _run(setup, out)["new_clips"] == 0
    _assert_same_clips(out, setup["reference"])
    grown = tmp_path / "grown.jsonl"
    grown.write_text(setup["manifest"].read_text() + json.dumps({"image": str(setup["root"] / "2.png"),
                                                                 "caption": "one more"}) + "\n")
    summary = _run(setup, out, manifest=grown)
    assert (summary["resumed_at"], summary["new_clips"], summary["clips"]) == (ROWS, 1, ROWS + 1)
    assert [c["line"] for c in read_folder(out)] == list(range(1, ROWS + 2))


def test_resume_refuses_other_options_an_edited_manifest_and_a_second_writer(setup: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(setup["reference"], out)
    with pytest.raises(LoongError, match="other options or encoders.*buckets"):
        _run(setup, out, buckets="5x32x32")
    edited = tmp_path / "edited.jsonl"
    lines = setup["manifest"].read_text().splitlines(keepends=True)
    edited.write_text("".join([lines[0].replace("a car 0", "a boat"), *lines[1:]]))
    with pytest.raises(LoongError, match="differs from .*edited.jsonl's first 6 lines"):
        _run(setup, out, manifest=edited)
    with (out / writer.LOCK).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(LoongError, match="another preprocess is writing"):
            _run(setup, out)
