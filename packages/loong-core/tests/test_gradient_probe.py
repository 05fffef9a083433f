"""GradientProbe: the first non-finite gradient of a backward pass, named by module."""

from __future__ import annotations

import torch

from loong.core.debug import GradientProbe


class _NaNBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return torch.where(g > 0, float("nan"), g)


class _Faulty(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NaNBackward.apply(x) * 2


def test_a_nan_born_inside_a_module_is_named_at_its_input() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), _Faulty(), torch.nn.Linear(8, 1))
    probe = GradientProbe([model])
    model(torch.randn(3, 4)).sum().backward()
    report = probe.report()
    # module 0's output is module 1's input: one tensor, both names
    assert report is not None and report.startswith("first non-finite: the gradient of output 0 of 0 = input 0 of 1 "
                                                    "(3, 8)")
    assert report.endswith("the last finite output gradient before it: output 0 of 1 = input 0 of 2")
    # a clean pass after reset reports nothing; removed hooks see nothing
    probe.reset()
    torch.nn.Sequential(model[0], model[2])(torch.randn(3, 4)).sum().backward()
    assert probe.report() is None
    probe.remove()
    model(torch.randn(3, 4)).sum().backward()
    assert probe.report() is None
