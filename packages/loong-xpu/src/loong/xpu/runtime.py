"""Finding and checking Kunlun's PyTorch runtime, ``torch_xmlir``.

What the plugin expects (docs/hardware.md gives the sources and how sure we are of each point):

* Kunlun's PyTorch is *XPyTorch*: an official torch build plus the ``torch_xmlir`` package, installed by
  Kunlunxin's ``xpytorch-cp<python>-torch<version>`` installer. Its ``torch_xmlir.pth`` hook imports
  ``torch_xmlir`` as the interpreter starts; ``DISABLE_XPYTORCH=1`` switches the hook and the runtime off.
* It adds no device type. It takes over torch's CUDA dispatch key, so Kunlun XPUs appear as
  ``torch.device("cuda", i)`` and are driven through ``torch.cuda``. Torch's own ``"xpu"`` device type
  belongs to Intel GPUs (``torch.xpu`` sees no Kunlun device) and is never used here.
* Collectives: it registers a BKCL process group with ``torch.distributed`` (``kccl``; ``bccl`` when
  ``XMLIR_ENABLE_NEW_PG=0``) and rewrites the backend name ``"nccl"`` to it.

Everything the plugin reads from the process goes through a :class:`Host`, so the mapping logic is
tested against a simulated runtime (``packages/loong-xpu/tests/simulated_kunlun_runtime.py``); no
real Kunlun device was used to write or test this module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from loong.core.errors import LoongError

RUNTIME_MODULE = "torch_xmlir"
DISABLE_VAR = "DISABLE_XPYTORCH"
NEW_PG_VAR = "XMLIR_ENABLE_NEW_PG"
INSTALL_HINT = (
    "install Kunlunxin's XPyTorch into this environment (the xpytorch-cp<python>-torch<version> "
    "installer from the Kunlunxin SDK; it provides the torch_xmlir module)"
)
VISIBILITY_HINT = (
    "check XPU_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, that `xpu-smi` lists the cards, and in a container "
    "that /dev/xpu<N> and /dev/xpuctrl are passed in"
)


class Host(Protocol):
    """The parts of the process the plugin reads; :class:`ProcessHost` is the real one."""

    @property
    def environ(self) -> MutableMapping[str, str]:
        """The process environment (written only by the activation's defaults)."""
        ...

    def find_module(self, name: str) -> str | None:
        """Where module ``name`` would be imported from, or None; must not import it."""
        ...

    def import_module(self, name: str) -> ModuleType:
        """Import module ``name``."""
        ...

    def device_module(self) -> Any:
        """The torch module that drives the devices the runtime presents (``torch.cuda``)."""
        ...

    def registered_backends(self) -> Sequence[str]:
        """The backend names ``torch.distributed`` knows (``Backend.backend_list``)."""
        ...


class ProcessHost:
    """The running interpreter."""

    @property
    def environ(self) -> MutableMapping[str, str]:
        return os.environ

    def find_module(self, name: str) -> str | None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # a broken or half-installed package counts as absent
            return None
        if spec is None:
            return None
        return spec.origin or "(namespace package)"

    def import_module(self, name: str) -> ModuleType:
        return importlib.import_module(name)

    def device_module(self) -> Any:
        import torch

        return torch.cuda

    def registered_backends(self) -> Sequence[str]:
        import torch.distributed as dist

        return list(dist.Backend.backend_list)


def unavailable_reason(host: Host) -> str | None:
    """None when the runtime can be used; otherwise why not and what to do. Imports nothing."""
    if host.environ.get(DISABLE_VAR) == "1":
        return f"{DISABLE_VAR}=1 switches Kunlun's PyTorch runtime off; unset it to use the xpu accelerator"
    if host.find_module(RUNTIME_MODULE) is None:
        return f"Kunlun's PyTorch runtime is not installed (no module {RUNTIME_MODULE}); {INSTALL_HINT}"
    return None


def process_group_name(environ: Mapping[str, str]) -> str:
    """The BKCL process group torch_xmlir routes ``"nccl"`` to, by its own ``XMLIR_ENABLE_NEW_PG`` rule."""
    new = environ.get(NEW_PG_VAR, "1").strip().lower() in ("1", "true", "yes", "on")
    return "kccl" if new else "bccl"


def runtime_version(module: ModuleType) -> str:
    """``torch_xmlir.__version__`` as one line (it is a mapping of component -> version, not a string)."""
    version = getattr(module, "__version__", None)
    if isinstance(version, Mapping):
        parts = [f"{k} {v}" for k, v in version.items()]
        return ", ".join(parts[:6]) + (", ..." if len(parts) > 6 else "") if parts else "unknown"
    return "unknown" if version is None else str(version)


@dataclass(frozen=True)
class KunlunRuntime:
    """What :func:`load_runtime` found: enough to drive the devices and to report them."""

    version: str
    origin: str
    device_count: int
    process_group: str
    device_module: Any


def load_runtime(host: Host) -> KunlunRuntime:
    """Import the runtime and check that it presents devices and a BKCL process group.

    Raises :class:`LoongError` with what to install or check; changes nothing of its own on failure.
    """
    reason = unavailable_reason(host)
    if reason is not None:
        raise LoongError(f"xpu: {reason}")
    try:
        module = host.import_module(RUNTIME_MODULE)
    except Exception as exc:  # the runtime's own import failures (missing .so, driver mismatch, ...)
        raise LoongError(
            f"xpu: importing {RUNTIME_MODULE} failed ({type(exc).__name__}: {exc}); the XPyTorch install "
            "is incomplete or does not match this torch"
        ) from exc
    cuda = host.device_module()
    count = int(cuda.device_count()) if cuda.is_available() else 0
    if count < 1:
        raise LoongError(
            f"xpu: {RUNTIME_MODULE} is imported but torch.cuda sees no Kunlun device; {VISIBILITY_HINT}"
        )
    group = process_group_name(host.environ)
    if group not in host.registered_backends():
        raise LoongError(
            f"xpu: {RUNTIME_MODULE} did not register its BKCL process group '{group}' with "
            f"torch.distributed ({NEW_PG_VAR}={host.environ.get(NEW_PG_VAR, '1')}), so collectives would not "
            "reach BKCL; the runtime's start-up hook may have failed (run with LOG_SYMBOL_REPLACE=1 to see it)"
        )
    return KunlunRuntime(version=runtime_version(module), origin=str(getattr(module, "__file__", "?")),
                         device_count=count, process_group=group, device_module=cuda)
