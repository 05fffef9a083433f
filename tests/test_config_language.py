"""One config language (issue 24): the keys every CLI shares are spelled, typed and documented the same everywhere.

The CLIs are the installed ``RUN_CONFIGS`` entries (loong-llm, loong-vlm, loong-diffusion, loong-embodied), each
with its schema and its embedded default config (composed with ``loong.core.config.compose_config``, as the CLI's
``train`` does). The shared keys are every key of loong-core's ``TrainConfig`` (``train.*``) and ``ParallelConfig``
(``parallel.*``), ``output_dir`` and ``run_name`` (``train.resume`` is one of ``train.*``).

What "the same meaning" is, checkably:

1. **Name and type**: every CLI's schema has every shared key, under the same dotted name, with the same
   annotation as the core's (type, ``Literal`` choices, ``Check`` bounds and special values such as ``0: never``,
   and the ``KEEPS_RUN`` mark that decides whether a rerun continues the run). A modality may subclass
   ``TrainConfig`` to add keys, never to retype a shared one. Compared on the annotation itself and on the row the
   generated key reference (docs/configuration.md) prints for it: type, allowed, rerun.
2. **Behaviour defaults**: where to write (``output_dir``, ``run_name``), how a run continues (``train.resume``,
   ``train.checkpoint_checksums``, ``train.keep_last``, ``train.save_final``) and what a fault does
   (``train.on_nonfinite``, ``train.nonfinite_probe``) default to the same value in every CLI's composed config;
   schedule and batch defaults (``train.steps``, ``train.lr``, ...) are each modality's preset and may differ.
   Every composed default config carries all shared keys (none dropped or renamed by a YAML file).
3. **Keys added by a modality** to ``train.*`` / ``parallel.*`` that another modality also has mean the same there
   (same annotation), e.g. a key two modalities add must not be an int in one and a bool in the other.
4. **``--help``**: each CLI's ``train --help`` names the shared sections by the same names (``train.``,
   ``parallel.``, ``output_dir``, ``run_name``), and every key it names exists in that CLI's schema; the options
   and commands every CLI gets from the core kit (``--nproc-per-node``, ``--max-restarts``, ``env``) read the same.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from typing import Any

import pytest

from loong.core.config import compose_config
from loong.core.config.checks import hints, nested_dataclass
from loong.core.config.docs import rows
from loong.core.config.schema import ParallelConfig, RunConfig, TrainConfig
from loong.core.registry import RUN_CONFIGS

CLIS = ["loong-llm", "loong-vlm", "loong-diffusion", "loong-embodied"]
#: the same default in every CLI: where a run writes, how it continues, what a fault does
SAME_DEFAULT = ["output_dir", "run_name", "train.resume", "train.checkpoint_checksums", "train.keep_last",
                "train.save_final", "train.on_nonfinite", "train.nonfinite_probe"]


def _schema(cli: str) -> type:
    module, _, attr = RUN_CONFIGS.get(cli).schema.partition(":")
    return getattr(importlib.import_module(module), attr)


def _composed(cli: str) -> dict[str, Any]:
    source = RUN_CONFIGS.get(cli)
    _, plain = compose_config(source.config_module, source.config_name, [], _schema(cli))
    return plain


def _annotations(schema: type, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> its field's annotation, for every leaf key of ``schema``."""
    out: dict[str, Any] = {}
    for name, tp in hints(schema).items():
        sub = nested_dataclass(tp)
        if sub is not None and prefix + name in ("train", "parallel", "precision", "data", "model"):
            out.update(_annotations(sub, f"{prefix}{name}."))
        else:
            out[prefix + name] = tp
    return out


def _shared() -> dict[str, Any]:
    core = {f"train.{k}": v for k, v in hints(TrainConfig).items()}
    core |= {f"parallel.{k}": v for k, v in hints(ParallelConfig).items()}
    core |= {k: hints(RunConfig)[k] for k in ("output_dir", "run_name")}
    return core


def _rows(cli: str) -> dict[str, tuple[str, str, str]]:
    """Dotted key -> (type, allowed, rerun) as the generated key reference prints it."""
    return {key: (tp, allowed, rerun) for key, tp, allowed, _default, rerun in rows(_schema(cli), _composed(cli))}


def _get(plain: dict[str, Any], key: str) -> Any:
    node: Any = plain
    for part in key.split("."):
        assert isinstance(node, dict) and part in node, f"{key} is missing"
        node = node[part]
    return node


def test_every_modality_cli_is_installed() -> None:
    assert set(CLIS) <= set(RUN_CONFIGS.names()), RUN_CONFIGS.names()
    for cli in CLIS:
        assert issubclass(_schema(cli), RunConfig), cli


@pytest.mark.parametrize("cli", CLIS)
def test_shared_keys_have_the_cores_name_type_and_meaning(cli: str) -> None:
    theirs = _annotations(_schema(cli))
    reference = {k: (t, a, r) for k, t, a, _d, r in rows(RunConfig, {})}  # the core's own rows for the shared keys
    mine = _rows(cli)
    wrong = []
    for key, annotation in _shared().items():
        if key not in theirs:
            wrong.append(f"{key}: missing")
        elif theirs[key] != annotation:
            wrong.append(f"{key}: {theirs[key]!r} (core: {annotation!r})")
        elif mine.get(key) != reference.get(key):
            wrong.append(f"{key}: documented as {mine.get(key)} (core: {reference.get(key)})")
    assert not wrong, f"{cli}: " + "; ".join(wrong)


@pytest.mark.parametrize("cli", CLIS)
def test_composed_defaults_carry_every_shared_key(cli: str) -> None:
    plain = _composed(cli)
    for key in _shared():
        _get(plain, key)


def test_behaviour_defaults_are_the_same_in_every_cli() -> None:
    composed = {cli: _composed(cli) for cli in CLIS}
    for key in SAME_DEFAULT:
        values = {cli: _get(plain, key) for cli, plain in composed.items()}
        assert len({repr(v) for v in values.values()}) == 1, f"{key} defaults differ: {values}"
    assert composed["loong-llm"]["train"]["resume"] == "auto"  # docs/checkpoints.md: rerunning continues the run


def test_keys_two_modalities_add_mean_the_same_in_both() -> None:
    shared = _shared()
    seen: dict[str, tuple[str, Any]] = {}
    wrong = []
    for cli in CLIS:
        for key, annotation in _annotations(_schema(cli)).items():
            if key in shared or not key.startswith(("train.", "parallel.")):
                continue
            if key in seen and seen[key][1] != annotation:
                wrong.append(f"{key}: {annotation!r} in {cli}, {seen[key][1]!r} in {seen[key][0]}")
            seen.setdefault(key, (cli, annotation))
    assert not wrong, wrong


def _help(cli: str, *argv: str) -> str:
    main = importlib.import_module(f"loong.{cli.removeprefix('loong-')}.cli").main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return out.getvalue()


def _named_keys(text: str) -> set[str]:
    """Every dotted key a help text names: ``train.steps``, and ``a.{b,c}`` expanded to ``a.b``, ``a.c``."""
    text = re.sub(r"\s+", "", text[text.index("keys:"):]) if "keys:" in text else ""
    keys = set()
    for prefix, inner in re.findall(r"\b([a-z_]+(?:\.[a-z_]+)*)\.\{([^}]*)\}", text):
        keys |= {f"{prefix}.{item}" for item in inner.split(",") if re.fullmatch(r"[a-z_]+", item)}
    keys |= set(re.findall(r"\b((?:train|parallel|precision)\.[a-z_]+)(?![.{a-z_])", text))
    return keys


@pytest.mark.parametrize("cli", CLIS)
def test_train_help_names_the_shared_keys_as_the_schema_does(cli: str) -> None:
    text = _help(cli, "train")
    for name in ("train.", "parallel.", "output_dir", "run_name"):
        assert name in text, f"{cli} train --help does not name {name}"
    schema = _annotations(_schema(cli))
    sections = {k.split(".")[0] for k in schema}
    named = _named_keys(text)
    assert any(k.startswith("train.") for k in named) and any(k.startswith("parallel.") for k in named), named
    unknown = sorted(k for k in named if k.split(".")[0] in sections and k not in schema
                     and not k.startswith("model."))
    assert not unknown, f"{cli} train --help names keys its schema does not have: {unknown}"


def test_the_core_options_and_commands_read_the_same_in_every_cli() -> None:
    def common_lines(text: str) -> list[str]:
        lines = text.splitlines()
        return [line.strip() for line in lines if re.match(r"\s+(--nproc-per-node|--max-restarts|env)\b", line)]

    seen = {cli: common_lines(_help(cli)) for cli in CLIS}
    assert all(len(v) >= 3 for v in seen.values()), seen
    assert len({tuple(v) for v in seen.values()}) == 1, seen
