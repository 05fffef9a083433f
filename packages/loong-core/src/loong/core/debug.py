"""Where a backward pass first produces NaN/Inf: :class:`GradientProbe` (``train.nonfinite_probe=true``).

Knowing *which parameters* ended with non-finite gradients rarely says where the NaN was born: it spreads to
everything upstream. The probe watches the gradient of every module's inputs and outputs as the backward visits
them and keeps the first one that is not finite, with the last finite output gradient seen before it. A NaN born
inside a module ``M`` shows up as a finite gradient at ``M``'s output and a non-finite one at its input; a NaN
born between modules (in functional code, e.g. an attention core written with einsum) shows up as a non-finite
gradient at the output of the module whose output that code consumed.

It costs a device synchronisation per hooked tensor, so it is for finding a fault, not for production runs. With
activation recomputation the hooks fire on the recomputed forward, which is the one the backward differentiates.
"""

from __future__ import annotations

from typing import Any

import torch


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


class GradientProbe:
    """Hooks on every submodule of ``modules`` (named as in ``named_modules()``) that report the first
    non-finite gradient of the current backward pass; :meth:`reset` before each step."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self._handles = []
        self.first: str | None = None
        self._last_finite: str | None = None
        for root in modules:
            for name, module in root.named_modules():
                self._handles.append(module.register_forward_hook(self._forward_hook(name or type(root).__name__)))

    def _forward_hook(self, name: str) -> Any:
        def hook(_module: torch.nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for where, values in (("output", output), ("input", args)):
                for i, t in enumerate(_tensors(values)):
                    if not (t.requires_grad and t.is_floating_point()):
                        continue
                    # one hook per tensor, under every name it has (module A's output is module B's input)
                    labels = getattr(t, "_loong_probe_labels", None)
                    if labels is None:
                        labels = []
                        t._loong_probe_labels = labels
                        t.register_hook(self._grad_hook(labels))
                    labels.append(f"{where} {i} of {name}")

        return hook

    def _grad_hook(self, labels: list[str]) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self.first is not None:
                return
            label = " = ".join(labels)
            if bool(torch.isfinite(grad).all()):
                if any(x.startswith("output") for x in labels):
                    self._last_finite = label
                return
            nan, inf = int(torch.isnan(grad).sum()), int(torch.isinf(grad).sum())
            self.first = (f"the gradient of {label} {tuple(grad.shape)} ({nan} NaN, {inf} Inf); the last finite "
                          f"output gradient before it: {self._last_finite or 'none'}")

        return hook

    def reset(self) -> None:
        """Forget the last pass."""
        self.first, self._last_finite = None, None

    def report(self) -> str | None:
        """``"first non-finite: ..."`` for this pass, or None when every gradient it saw was finite."""
        return None if self.first is None else f"first non-finite: {self.first}"

    def remove(self) -> None:
        """Take the hooks off the modules."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


__all__ = ["GradientProbe"]
