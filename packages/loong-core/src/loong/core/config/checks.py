"""Constraints on config values, declared in the schemas' field annotations (``typing.Annotated``).

See :mod:`loong.core.config.schema` for how a schema uses them; this module holds the pieces: :class:`Check`
(ranges, extra allowed values, non-empty, paths that must exist), :data:`KEEPS_RUN` (keys a rerun may change and
still continue the run), the common aliases, and the walks over a schema that the validator, the run directory and
the generated reference (``docs/configuration.md``) share.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from loong.core.errors import LoongError


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Check:
    """What one config value may be, beyond its type.

    ``ge`` / ``gt`` / ``le`` / ``lt`` bound a number; ``also`` lists values allowed outside the bounds (``-1``: what
    the world leaves); ``note`` says what special values mean (``0: never``); ``nonempty`` refuses ``""`` and ``[]``;
    ``path`` (``file``, ``dir``, ``exists``) is a path that must exist when a run starts (:func:`check_paths`).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple[Any, ...] = ()
    note: str = ""
    nonempty: bool = False
    path: Literal["file", "dir", "exists"] | None = None

    def allowed(self) -> str:
        """What the check allows, in words (``>= 1``, ``in [0, 1)``, ``an existing folder``)."""
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = f"{'>=' if self.ge is not None else '>'} {low[1:]}"
        elif high:
            text = f"{'<=' if self.le is not None else '<'} {high[:-1]}"
        elif self.path:
            text = {"file": "an existing file", "dir": "an existing folder", "exists": "an existing path"}[self.path]
        elif self.nonempty:
            text = "non-empty"
        else:
            return self.note or "any value"
        if self.nonempty and text != "non-empty":
            text = f"non-empty, {text}"
        if self.also:
            text += " or " + " or ".join(str(v) for v in self.also)
        return text + (f" ({self.note})" if self.note else "")

    def check(self, value: Any, path: str) -> None:
        """Raise LoongError naming ``path``, the value and what is allowed when ``value`` breaks the check
        (existence of paths is :func:`check_paths`'s)."""
        if value in self.also and type(value) is not bool:
            return
        bad = self.nonempty and hasattr(value, "__len__") and len(value) == 0
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            bad = bad or (self.ge is not None and not value >= self.ge) or (self.gt is not None and not value > self.gt)
            bad = bad or (self.le is not None and not value <= self.le) or (self.lt is not None and not value < self.lt)
        if bad:
            raise LoongError(f"{path}={show(value)}: must be {self.allowed()}")


@dataclass(frozen=True)
class KeepsRun:
    """Marks a key that does not change what is trained (how long, how often to log, evaluate or save, where to write,
    what to do on a failure): it is left out of the run's identity, so a rerun that changes only such keys continues
    the run (:mod:`loong.core.run_dir`)."""


#: the :class:`KeepsRun` marker: ``steps: Annotated[int, Check(ge=1), KEEPS_RUN] = 200``
KEEPS_RUN = KeepsRun()

PositiveInt = Annotated[int, Check(ge=1)]
NonNegativeInt = Annotated[int, Check(ge=0)]
PositiveFloat = Annotated[float, Check(gt=0)]
NonNegativeFloat = Annotated[float, Check(ge=0)]
Probability = Annotated[float, Check(ge=0, le=1)]
NonEmptyStr = Annotated[str, Check(nonempty=True)]
ExistingDir = Annotated[str, Check(path="dir")]
ExistingFile = Annotated[str, Check(path="file")]


def show(value: Any) -> str:
    """A value as the user would write it on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value) if not isinstance(value, str) else value


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """A dataclass's field annotations with their ``Annotated`` metadata (resolved once per class)."""
    return typing.get_type_hints(cls, include_extras=True)


def split(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """``Annotated[T, m1, m2]`` → ``(T, (m1, m2))``; any other annotation → ``(tp, ())``."""
    if typing.get_origin(tp) is Annotated:
        inner, *meta = typing.get_args(tp)
        return inner, tuple(meta)
    return tp, ()


def union_arms(tp: Any) -> tuple[Any, ...] | None:
    """The arms of a union annotation (``int | None`` → ``(int, NoneType)``), None for anything else."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def nested_dataclass(tp: Any) -> type | None:
    """The dataclass a field holds (``Cfg`` or ``Cfg | None``), or None."""
    base, _ = split(tp)
    for arm in union_arms(base) or (base,):
        arm, _ = split(arm)
        if dataclasses.is_dataclass(arm):
            return arm  # type: ignore[return-value]
    return None


def describe(tp: Any) -> str:
    """What annotation ``tp`` takes, in words (``an integer >= 1 or null``), for errors about unions."""
    base, meta = split(tp)
    checks = [m for m in meta if isinstance(m, Check)]
    arms = union_arms(base)
    if arms is not None:
        return " or ".join(describe(a) for a in arms)
    if any(c.path for c in checks):
        return next(c for c in checks if c.path).allowed()
    origin = typing.get_origin(base)
    if base is type(None):
        text = "null"
    elif origin is Literal:
        text = " or ".join(repr(c) for c in typing.get_args(base))
    elif origin in (list, tuple):
        (item, *_) = typing.get_args(base) or (Any,)
        text = f"a list of {describe(item)} values" if item is not Any else "a list"
    elif dataclasses.is_dataclass(base) or base is dict or origin is dict:
        text = "a mapping"
    else:
        text = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(base, "any value")
    return " ".join([text, *(c.allowed() for c in checks)])


def metadata(tp: Any) -> list[Any]:
    """Every metadata object of an annotation, a union's arms' included."""
    base, meta = split(tp)
    out = list(meta)
    for arm in union_arms(base) or ():
        out += split(arm)[1]
    return out


@functools.cache
def keeps_run_keys(cls: type, prefix: str = "") -> frozenset[str]:
    """The dotted keys of schema ``cls`` marked :data:`KEEPS_RUN`."""
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        tp, dotted = hints(cls)[f.name], f"{prefix}{f.name}"
        if any(isinstance(m, KeepsRun) for m in metadata(tp)):
            out.add(dotted)
        sub = nested_dataclass(tp)
        if sub is not None:
            out |= keeps_run_keys(sub, dotted + ".")
    return frozenset(out)


def check_paths(obj: Any, prefix: str = "") -> None:
    """Raise LoongError for the first field of the config tree ``obj`` declared ``Check(path=...)`` whose path does
    not exist. Called where a config comes from the user (``compose_config``); :func:`~loong.core.config.schema.
    from_dict` alone does not, since it also reads the configs saved in checkpoints, whose paths may be elsewhere."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        value, dotted = getattr(obj, f.name), f"{prefix}{f.name}"
        for m in metadata(hints(type(obj))[f.name]):
            if isinstance(m, Check) and m.path and isinstance(value, str):
                p = Path(value)
                ok = {"file": p.is_file, "dir": p.is_dir, "exists": p.exists}[m.path]()
                if not ok:
                    why = "does not exist" if not p.exists() else {"file": "is a folder", "dir": "is a file"}[m.path]
                    raise LoongError(f"{dotted}={value}: must be {m.allowed()} ({value} {why})")
        if dataclasses.is_dataclass(value):
            check_paths(value, dotted + ".")
