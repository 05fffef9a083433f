"""The training step's host-stall hazards on the tiny VLMs (one CPU process, fp32; issue 21).

- ``data.packing=false`` hands the foundation no document ids (plain causal attention): the loss and every
  gradient equal the document-id path's on rows with padding.
- No device-to-host sync inside the model: a dispatch mode records the ops that, on a GPU, make the host wait for
  the device (``item`` / ``_local_scalar_dense``, ``nonzero``, ``equal``, ``masked_select``, ``unique``, boolean
  indexing, ``repeat_interleave`` without ``output_size``, ``bincount``) while the model runs one training
  micro-batch forward (encoder, projector, foundation) and backward. On the CPU these ops cost nothing, so the
  check is on the ops called, not on time. The host metadata (grids, placeholder counts) are plain CPU values
  there as on a GPU, so the same code path is checked.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from vlm_layouts import build, one_step  # noqa: E402

from loong.core.accelerators import select_accelerator  # noqa: E402
from loong.core.engines.megatron.engine import MegatronEngine  # noqa: E402
from loong.core.engines.megatron.layout import shutdown_distributed  # noqa: E402
from loong.core.engines.megatron.state import unwrap  # noqa: E402
from loong.core.host_sync import DeviceSyncRecorder  # noqa: E402
from loong.vlm.task import VLMTask  # noqa: E402

MODELS = {"qwen2_5_vl": "model=tiny", "qwen3_vl": "model=tiny_qwen3_vl"}
UNPACKED = ["data.packing=false", "train.micro_batch_size=2", "train.global_batch_size=4"]

#: code the CPU run takes where a GPU takes another path: the reference varlen attention (the GPU's encoder runs
#: FlexAttention, ``choose_varlen_impl``) and megatron's unfused cross entropy (the GPU's loss is loong-kernels'
#: fused one); the ops they call are recorded apart, in ``other_paths_seen``
OTHER_PATHS = ("loong/core/attention/varlen.py", "megatron/core/tensor_parallel/cross_entropy.py")


def _step(root: Path, overrides: list[str], mode: DeviceSyncRecorder | None = None) -> dict:
    """One training step's loss and gradients (no optimiser step); with ``mode``, the model's forward and
    backward run under it (set active by hooks around the VLM's forward and the backward of its output)."""
    acc = select_accelerator("cpu")
    try:
        with acc.activate(engine="megatron"), contextlib.redirect_stderr(io.StringIO()):
            if mode is None:
                return one_step(root, overrides, acc)
            cfg, layout, task = build(root, overrides, acc)
            engine = MegatronEngine(task, cfg, acc, layout)
            vlm = unwrap(engine.model_chunks[0])

            def enter(*_):  # noqa: ANN002, ANN202
                mode.active = True

            def backward_starts(grad: torch.Tensor) -> torch.Tensor:  # at the model output's gradient
                mode.active = True
                # the backward's end (the loss function's backward, before, is not the model's)
                torch.autograd.Variable._execution_engine.queue_callback(lambda: setattr(mode, "active", False))
                return grad

            def leave(_module, _args, output):  # noqa: ANN001, ANN202
                mode.active = False
                if output.requires_grad:
                    output.register_hook(backward_starts)
                return output

            vlm.register_forward_pre_hook(enter)
            vlm.register_forward_hook(leave)
            for m in engine.model_chunks:
                m.zero_grad_buffer()
            nmb = task.num_train_microbatches(0, engine.num_microbatches)
            with mode:
                engine._run(engine._iterators(lambda: task.train_microbatches(0, nmb)), forward_only=False,
                            num_microbatches=nmb)
            return {}
    finally:
        shutdown_distributed()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vlm_host_sync")


@pytest.mark.parametrize("family", list(MODELS))
def test_unpacked_rows_without_document_ids_equal_the_document_mask(root: Path, family: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = [MODELS[family], *UNPACKED]
    acc = select_accelerator("cpu")
    try:  # the rows have padding after their one sample (else the comparison shows nothing)
        with acc.activate(engine="megatron"), contextlib.redirect_stderr(io.StringIO()):
            _, _, task = build(root, overrides, acc)
            assert not task.document_ids
            docs = [task.data.train[i]["document_ids"] for i in range(4)]
            assert all((d >= 0).any() and (d < 0).any() and d.max() == 0 for d in docs)
    finally:
        shutdown_distributed()
    plain = _step(root, overrides)
    monkeypatch.setattr(VLMTask, "document_ids", property(lambda self: True))
    masked = _step(root, overrides)
    assert plain["loss"] == pytest.approx(masked["loss"], rel=1e-6, abs=1e-6)
    assert set(plain["grads"]) == set(masked["grads"])
    for name, g in masked["grads"].items():
        assert g.abs().max() > 0 or name.startswith("foundation.embedding"), name
        err = float((plain["grads"][name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err <= 1e-6, (name, err)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
def test_the_model_forward_and_backward_never_sync_the_device(root: Path, family: str, packing: bool) -> None:
    mode = DeviceSyncRecorder(other_paths=OTHER_PATHS)
    _step(root, [MODELS[family], f"data.packing={str(packing).lower()}", "train.micro_batch_size=2",
                 "train.global_batch_size=4"], mode)
    assert mode.seen == [], "device-to-host syncs in the model:\n" + "\n".join(sorted(set(mode.seen)))
    assert mode.other_paths_seen <= {"aten.unique_consecutive.default in loong/core/attention/varlen.py",
                                "aten.index_put_.default in megatron/core/tensor_parallel/cross_entropy.py"}
