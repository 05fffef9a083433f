"""GradientProbe: the first non-finite gradient of a backward pass, named by module."""

from __future__ import annotations

import torch

from loong.core.debug import GradientProbe


class _Faulty(torch.nn.Module):
    """Doubles its input; its backward is infinite (d sqrt(u) / du at u = 0), as a broken kernel's might be."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + torch.sqrt(x - x.detach())


def test_a_nan_born_inside_a_module_is_named_at_its_input() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), _Faulty(), torch.nn.Linear(8, 1))
    probe = GradientProbe([model])
    model(torch.randn(3, 4)).sum().backward()
    report = probe.report()
    # module 0's output is module 1's input: one tensor, both names
    assert report is not None and report.startswith("first non-finite: the gradient of output 0 of 0 = input 0 of 1 "
                                                    "(3, 8) (0 NaN, 24 Inf)")
    assert report.endswith("the last finite output gradient before it: output 0 of 1 = input 0 of 2")
    # a clean pass after reset reports nothing; removed hooks see nothing
    probe.reset()
    torch.nn.Sequential(model[0], model[2])(torch.randn(3, 4)).sum().backward()
    assert probe.report() is None
    probe.remove()
    model(torch.randn(3, 4)).sum().backward()
    assert probe.report() is None
