"""Environment defaults the xpu accelerator sets while it is active (a value the user set always wins).

Only variables read *after* start-up belong here: the BKCL library reads its ``BKCL_*`` settings when
a communicator is created, which is after the accelerator activates. Settings that ``torch_xmlir``
reads while it is imported (``XMLIR_ENABLE_FAST_FC``, ``XMLIR_PARALLEL_SAVE_MEMORY``,
``CUDA_DEVICE_MAX_CONNECTIONS``, ...) cannot be set by a plugin: XPyTorch imports the runtime when the
interpreter starts. docs/hardware.md lists those for the launch script.

The values follow what Baidu's Megatron training scripts for the P800 set (LoongForge's
``examples_xpu``) and FlagScale's Kunlun Megatron script; none of them was tried on a Kunlun card here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvDefault:
    """``name=value`` unless the user set ``name``; ``why`` is shown in the docs and the tests."""

    name: str
    value: str
    why: str


DEFAULTS: tuple[EnvDefault, ...] = (
    EnvDefault("BKCL_TIMEOUT", "1800",
               "BKCL's own timeout (seconds), the same 30 minutes Loong gives torch.distributed, so a stuck "
               "collective fails on one deadline (FlagScale's Kunlun Megatron script sets 1800)"),
    EnvDefault("BKCL_TREE_THRESHOLD", "0",
               "as every one of LoongForge's P800 Megatron scripts sets (by its name: the message size "
               "under which BKCL uses tree algorithms, so 0 means rings throughout)"),
    EnvDefault("BKCL_FORCE_L3_RDMA", "0",
               "RDMA buffers stay out of the card's L3; LoongForge's P800 scripts set 0 and warn that 1 can "
               "run out of memory"),
)
# Not defaults, because they depend on the cluster's network (docs/hardware.md lists them for multi-node
# runs): BKCL_RDMA_NICS, BKCL_SOCKET_IFNAME, BKCL_ENABLE_XDR, BKCL_ALL_TO_ALL_OPT.


@contextlib.contextmanager
def environment_defaults(environ: MutableMapping[str, str],
                         defaults: tuple[EnvDefault, ...] = DEFAULTS) -> Iterator[list[str]]:
    """Set every default whose variable is unset; on exit remove exactly those again.

    Yields the names it set. A variable changed by someone else meanwhile is left as it is.
    """
    applied: list[str] = []
    for d in defaults:
        if d.name not in environ:
            environ[d.name] = d.value
            applied.append(d.name)
    try:
        yield applied
    finally:
        by_name = {d.name: d.value for d in defaults}
        for name in applied:
            if environ.get(name) == by_name[name]:
                del environ[name]
