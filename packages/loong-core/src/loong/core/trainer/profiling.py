"""``train.profile_steps=[start, end]``: torch.profiler over a window of training steps.

Megatron-LM (``--profile``) and torchtitan (``profiling.enable_profiling``) both offer this, because the
first question about a slow step is where its time goes. The window opens before step ``start`` and
closes after step ``end`` (1-based, inclusive), so warm-up steps can be left out. On the logging rank it
writes ``profile/trace.json`` (open in Perfetto or chrome://tracing) and ``profile/ops.txt`` (operators
sorted by device time, or CPU time on CPU, under a first line that compares the window's wall time with
the device time its operators add up to: a device busy well below 100% means the step waits on the host),
and says where they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from loong.core.errors import LoongError


class StepProfiler:
    """Opens a torch.profiler session for steps ``[start, end]`` and writes its results once closed."""

    def __init__(self, window: list[int], run_dir: Path, logging_rank: bool, device_type: str) -> None:
        if window and (len(window) != 2 or not 1 <= window[0] <= window[1]):
            raise LoongError(f"train.profile_steps={window}: give [start, end] with 1 <= start <= end "
                             "(1-based steps, both profiled)")
        self.window = window
        self.dir = run_dir / "profile"
        self.logging_rank = logging_rank
        self.device_type = device_type
        self._prof: torch.profiler.profile | None = None
        self._opened = 0.0
        self._wall_s = 0.0
        self.written: list[Path] = []

    def before_step(self, step: int) -> None:
        """Call with the 1-based number of the step about to run."""
        if self.window and self._prof is None and step == self.window[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device_type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.__enter__()
            self._opened = time.perf_counter()

    def after_step(self, step: int, synchronize: Callable[[], None]) -> None:
        """Call with the 1-based number of the step that just ran; closes the window after its last step."""
        if self._prof is not None and step >= self.window[1]:
            synchronize()
            self._wall_s = time.perf_counter() - self._opened
            self.close()

    def close(self) -> None:
        """End the session (early if the run stops inside the window) and write the results."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        if not self.logging_rank:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / "trace.json"
        prof.export_chrome_trace(str(trace))
        key = "self_cuda_time_total" if self.device_type == "cuda" else "self_cpu_time_total"
        averages = prof.key_averages(group_by_input_shape=False)
        table = averages.table(sort_by=key, row_limit=40)
        ops = self.dir / "ops.txt"
        ops.write_text(self._headline(averages) + table + "\n")
        self.written = [trace, ops]

    def _headline(self, averages: object) -> str:
        """``steps a-b: W s wall, D s of device operators (P% busy)``; empty without a device or a wall time
        (a run stopped inside the window)."""
        if self.device_type != "cuda" or not self._wall_s:
            return ""
        # what torch's own table footer sums as "Self CUDA time total": the device-side events (kernels, memcpy),
        # not the host operators that launched them (those carry the same time again) or user annotations
        device_s = sum(e.self_device_time_total for e in averages  # type: ignore[attr-defined]
                       if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / 1e6
        return (f"steps {self.window[0]}-{self.window[1]}: {self._wall_s:.3f} s wall, {device_s:.3f} s of device "
                f"operators ({device_s / self._wall_s:.0%} busy)\n")
