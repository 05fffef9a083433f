"""``MegatronOnCPU``: the CUDA stand-ins stock megatron-core needs on CPU, and their clean removal.

The target check makes a megatron-core/torch upgrade that moves a patched attribute fail here, by name,
instead of deep inside a training run. Runs on a machine without CUDA (the redirect tests assume so).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from loong.core.accelerators import available_accelerators, select_accelerator
from loong.core.accelerators.cpu import CPUAccelerator
from loong.core.accelerators.megatron_cpu import ADAPTATIONS, Adaptation, CudaCallsOnCPU, MegatronOnCPU
from loong.core.errors import LoongError

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour on a machine without CUDA")


def _mode_stack() -> list:
    return list(torch.overrides._get_current_function_mode_stack())


def _originals() -> dict[tuple[str, str], object]:
    found = {(ad.module, ad.attr): getattr(importlib.import_module(ad.module), ad.attr) for ad in ADAPTATIONS}
    found[("torch.Tensor", "record_stream")] = torch.Tensor.record_stream
    return found


def _assert_restored(before: dict[tuple[str, str], object]) -> None:
    assert _originals().keys() == before.keys()
    for key, original in _originals().items():
        assert original is before[key], f"{key[0]}.{key[1]} was not restored"
    assert not any(isinstance(m, CudaCallsOnCPU) for m in _mode_stack()), "torch-function mode left active"
    assert torch.ones(1).type() == "torch.FloatTensor"


@pytest.mark.parametrize("ad", ADAPTATIONS, ids=lambda ad: f"{ad.module}.{ad.attr}")
def test_every_adaptation_target_exists(ad: Adaptation) -> None:
    module = importlib.import_module(ad.module)
    assert hasattr(module, ad.attr), (
        f"{ad.module}.{ad.attr} is gone; the adaptation was needed because {ad.why}"
    )
    assert callable(getattr(module, ad.attr))
    assert ad.why.strip()
    assert callable(ad.make())


def test_record_stream_target_exists() -> None:
    assert callable(torch.Tensor.record_stream)


def test_megatron_core_is_the_measured_version() -> None:
    import megatron.core

    major, minor, *_ = (int(p) for p in megatron.core.__version__.split(".")[:2])
    assert (major, minor) == (0, 19), (
        f"adaptations were measured on 0.19.x, found {megatron.core.__version__}"
    )


def test_adaptation_targets_are_unique() -> None:
    keys = [(ad.module, ad.attr) for ad in ADAPTATIONS]
    assert len(keys) == len(set(keys))


@no_cuda
def test_cuda_calls_land_on_the_cpu_inside_the_context() -> None:
    with MegatronOnCPU():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device="cuda:0").device.type == "cpu"
        assert torch.empty(3, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(2, device=0).device.type == "cpu"
        t = torch.ones(3)
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert t.to(device="cuda:0").device.type == "cpu"
        assert t.to(torch.float64).dtype == torch.float64  # non-device .to() is untouched
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(1).type(torch.float64).dtype == torch.float64  # type(dtype) still converts
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(1, device=torch.cuda.current_device()).device.type == "cpu"
        torch.cuda.synchronize()
        torch.cuda.manual_seed(0)
        t.record_stream(torch.cuda.current_stream())


@no_cuda
def test_streams_and_events_are_no_ops() -> None:
    with MegatronOnCPU():
        stream = torch.cuda.Stream()
        side = torch.cuda.Stream(priority=-1)
        event = torch.cuda.Event()
        assert event.record() is None and event.query() is True
        event.synchronize()
        event.wait(stream)
        stream.wait_stream(torch.cuda.current_stream())
        stream.wait_event(event)
        stream.synchronize()
        assert stream.record_event().query() is True
        assert torch.cuda.current_stream() == stream == side  # one host "stream"
        assert len({stream, side, torch.cuda.current_stream()}) == 1
        with torch.cuda.stream(side):
            x = torch.ones(2, device="cuda") * 2
        assert x.tolist() == [2.0, 2.0]


@no_cuda
def test_exit_restores_every_original() -> None:
    before = _originals()
    with MegatronOnCPU():
        for key, original in _originals().items():
            assert original is not before[key], f"{key} was not patched"
        assert any(isinstance(m, CudaCallsOnCPU) for m in _mode_stack())
    _assert_restored(before)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


@no_cuda
def test_exit_restores_after_an_exception() -> None:
    before = _originals()
    with pytest.raises(ZeroDivisionError), MegatronOnCPU():
        1 / 0  # noqa: B018
    _assert_restored(before)


@no_cuda
def test_reentering_works_twice_in_a_row() -> None:
    before = _originals()
    ctx = MegatronOnCPU()
    for _ in range(2):
        with ctx:
            assert torch.zeros(1, device="cuda").device.type == "cpu"
        _assert_restored(before)
    for _ in range(2):
        with MegatronOnCPU():
            assert torch.zeros(1, device="cuda").device.type == "cpu"
        _assert_restored(before)


@no_cuda
def test_nested_contexts_unwind_in_order() -> None:
    before = _originals()
    with MegatronOnCPU():
        with MegatronOnCPU():
            assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.zeros(1, device="cuda").device.type == "cpu"  # outer still active
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    _assert_restored(before)


@no_cuda
def test_nesting_one_instance_unwinds_in_order() -> None:
    before = _originals()
    ctx = MegatronOnCPU()
    with ctx:
        with ctx:
            pass
        assert torch.cuda.current_device() == "cpu"  # outer still active
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    _assert_restored(before)


def test_a_missing_target_fails_by_name_and_patches_nothing() -> None:
    before = _originals()
    broken = (
        *ADAPTATIONS,
        Adaptation("torch.cuda", "no_such_attribute_xyz", lambda: None, "the test says so"),
    )
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.no_such_attribute_xyz is gone.*the test says so"):
        with MegatronOnCPU(broken):
            pass
    _assert_restored(before)


# --- megatron-core's RNG tracker on the host generator -----------------------------------------


def _stream(seed: int, n: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


@no_cuda
def test_rng_tracker_fork_draws_a_seeded_stream_and_leaves_the_default_one_alone() -> None:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with MegatronOnCPU():
        torch.manual_seed(0)
        tracker = CudaRNGStatesTracker()
        tracker.add("x", 5)
        a = torch.rand(4)
        with tracker.fork("x"):
            f1 = torch.rand(4)
        b = torch.rand(4)
        with tracker.fork("x"):
            f2 = torch.rand(4)
        c = torch.rand(4)

    # The forked stream is the one seeded by add()'s seed, continued across forks (as on a GPU) ...
    assert torch.equal(torch.cat([f1, f2]), _stream(5, 8))
    # ... and the default stream continues as if the forks never happened.
    assert torch.equal(torch.cat([a, b, c]), _stream(0, 12))
    assert not torch.equal(f1, a)


@no_cuda
def test_model_parallel_seed_gives_distinct_reproducible_per_rank_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # model_parallel_cuda_manual_seed replaces megatron's global tracker: put the old one back afterwards.
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", mrandom._CUDA_RNG_STATE_TRACKER)
    monkeypatch.setattr(
        mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED
    )

    def draws(tp_rank: int) -> dict[str, torch.Tensor]:
        with MegatronOnCPU():
            torch.manual_seed(123)
            mrandom.model_parallel_cuda_manual_seed(
                123, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True
            )
            tracker = mrandom.get_cuda_rng_tracker()
            out = {}
            for name in ("model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"):
                with tracker.fork(name):
                    out[name] = torch.rand(4)
            out["default"] = torch.rand(4)
        return out

    r0, r0_again, r1 = draws(0), draws(0), draws(1)
    for name in r0:
        assert torch.equal(r0[name], r0_again[name]), f"{name} is not reproducible"
    # megatron's seeds: data-parallel = seed, model-parallel = seed + 2718 + tp_rank, expert = seed + 1024.
    assert torch.equal(r0["data-parallel-rng"], _stream(123, 4))
    assert torch.equal(r0["model-parallel-rng"], _stream(123 + 2718, 4))
    assert torch.equal(r1["model-parallel-rng"], _stream(123 + 2718 + 1, 4))
    assert torch.equal(r0["expert-parallel-rng"], _stream(123 + 1024, 4))
    assert not torch.equal(r0["model-parallel-rng"], r1["model-parallel-rng"])  # TP ranks differ
    assert torch.equal(r0["data-parallel-rng"], r1["data-parallel-rng"])
    assert torch.equal(r0["default"], _stream(123, 4))  # forks left the host stream where it was


# --- accelerator selection ----------------------------------------------------------------------


def test_installed_accelerators() -> None:
    found = available_accelerators()
    assert {"cpu", "cuda"} <= set(found)
    assert found["cpu"] is CPUAccelerator


def test_env_var_picks_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOONG_ACCELERATOR", "cpu")
    acc = select_accelerator()
    assert isinstance(acc, CPUAccelerator)
    assert (acc.device_type, acc.backend) == ("cpu", "gloo")
    assert acc.megatron_config_overrides()["use_cpu_initialization"] is True  # weights built on the host


@no_cuda
def test_cuda_is_installed_but_not_available_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOONG_ACCELERATOR", "cuda")
    with pytest.raises(LoongError, match="accelerator 'cuda' is installed but not available"):
        select_accelerator()


@no_cuda
def test_default_is_the_best_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOONG_ACCELERATOR", raising=False)
    assert isinstance(select_accelerator(), CPUAccelerator)


def test_explicit_name_wins_over_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOONG_ACCELERATOR", "no-such-thing")
    assert isinstance(select_accelerator("cpu"), CPUAccelerator)


def test_unknown_accelerator_names_the_closest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOONG_ACCELERATOR", "cdua")
    with pytest.raises(LoongError) as err:
        select_accelerator()
    msg = str(err.value)
    assert "unknown accelerator 'cdua'" in msg
    assert "did you mean 'cuda'?" in msg
    assert "installed: " in msg and "cpu" in msg


@no_cuda
def test_cpu_accelerator_activate_applies_and_removes_the_adaptations() -> None:
    before = _originals()
    with CPUAccelerator().activate():
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    _assert_restored(before)
