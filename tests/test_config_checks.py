"""The one mechanism that checks every config value (``loong.core.config.checks`` + ``schema.from_dict``), and the
generated key reference (``docs/configuration.md``) that is read off the same annotations."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from pathlib import Path
from typing import Annotated

import pytest

from loong.core.config import RunConfig, from_dict, to_dict
from loong.core.config.checks import (
    KEEPS_RUN,
    Check,
    check_paths,
    hints,
    keeps_run_keys,
    metadata,
    nested_dataclass,
    split,
    union_arms,
)
from loong.core.config.docs import main as docs_main
from loong.core.errors import LoongError
from loong.core.registry import RUN_CONFIGS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
#: numeric keys that may take any finite value
UNBOUNDED = {"train.logit_mean"}


def _schemas() -> dict[str, type]:
    out = {"loong.core": RunConfig}
    for cli in RUN_CONFIGS.names():
        module, _, attr = RUN_CONFIGS.get(cli).schema.partition(":")
        out[cli] = getattr(importlib.import_module(module), attr)
    return out


def _numeric_fields(schema: type, prefix: str = "") -> list[tuple[str, typing.Any]]:
    out = []
    for f in dataclasses.fields(schema):
        tp, key = hints(schema)[f.name], f"{prefix}{f.name}"
        sub = nested_dataclass(tp)
        if sub is not None:
            out += _numeric_fields(sub, key + ".")
            continue
        base = split(tp)[0]
        arms = [split(a)[0] for a in union_arms(base) or (base,) if a is not type(None)]
        items = [split(typing.get_args(a)[0])[0] for a in arms if typing.get_origin(a) is list and typing.get_args(a)]
        if any(a in (int, float) for a in arms + items):
            out.append((key, tp))
    return out


def test_every_installed_cli_registers_its_schema() -> None:
    assert {"loong-llm", "loong-diffusion"} <= set(RUN_CONFIGS.names())


@pytest.mark.parametrize("name", ["loong.core", "loong-llm", "loong-diffusion"])
def test_every_numeric_key_declares_its_range(name: str) -> None:
    """A key added without a Check would take any number: -5 steps, a probability of 3 (what this mechanism is for)."""
    schema = _schemas()[name]
    unchecked, numeric = [], _numeric_fields(schema)
    assert len(numeric) >= 30 and "train.steps" in dict(numeric)
    for key, tp in numeric:
        checks = [m for m in metadata(tp) if isinstance(m, Check)]
        base = split(tp)[0]
        for arm in union_arms(base) or (base,):
            arm_base = split(arm)[0]
            if typing.get_origin(arm_base) is list and typing.get_args(arm_base):
                inner = typing.get_args(arm_base)[0]
                while typing.get_origin(split(inner)[0]) is list:  # list[list[PositiveInt]]
                    checks += [m for m in metadata(inner) if isinstance(m, Check)]
                    inner = typing.get_args(split(inner)[0])[0]
                checks += [m for m in metadata(inner) if isinstance(m, Check)]
        if not checks and key not in UNBOUNDED:
            unchecked.append(key)
    assert not unchecked, f"give these keys a Check (or list them in UNBOUNDED with the reason): {unchecked}"
    # every schema's own defaults pass its checks
    from_dict(schema, to_dict(schema()))


def test_keys_that_keep_the_run() -> None:
    keys = keeps_run_keys(RunConfig)
    assert {"train.steps", "train.log_interval", "train.eval_interval", "train.save_interval", "train.resume",
            "train.on_nonfinite", "output_dir", "run_name", "train.progress"} <= keys
    assert not keys & {"train.lr", "train.seed", "train.global_batch_size", "parallel.tp", "model", "data.path"}


def test_union_errors_name_the_arm_of_the_value() -> None:
    @dataclasses.dataclass
    class S:
        size: Annotated[int, Check(ge=1)] | None = None
        mode: bool | typing.Literal["auto"] = "auto"
        cost: typing.Literal["a", "b"] | list[Annotated[float, Check(ge=0)]] = "a"
        decay: Annotated[float, Check(ge=0, lt=1, note="0: off"), KEEPS_RUN] = 0.0

    for data, message in [({"size": 0}, "size=0: must be >= 1"), ({"size": 1.5}, "size: expected an integer, got 1.5"),
                          ({"mode": "yes"}, "mode: yes is not true/false or 'auto'"),
                          ({"cost": "c"}, "cost: 'c' is not one of ['a', 'b']"),
                          ({"cost": [1, -1]}, "cost[1]=-1.0: must be >= 0"),
                          ({"decay": 1}, "decay=1.0: must be in [0, 1) (0: off)"),
                          ({"decay": float("inf")}, "decay=inf: must be a finite number")]:
        with pytest.raises(LoongError) as err:
            from_dict(S, data)
        assert str(err.value) == message
    assert from_dict(S, {"size": None, "mode": True, "cost": [1, 2]}) == S(None, True, [1.0, 2.0])
    assert keeps_run_keys(S) == {"decay"}


def test_paths_are_checked_when_a_run_starts_not_when_a_saved_config_is_read(tmp_path: Path) -> None:
    from loong.llm.schema import LLMRunConfig

    saved = {"model": {"init_from_hf": str(tmp_path / "moved")}, "precision": {"fp8_table": str(tmp_path)}}
    cfg = from_dict(LLMRunConfig, saved)  # a checkpoint's config.yaml, read on another machine: fine
    with pytest.raises(LoongError, match=r"^model\.init_from_hf=.*moved: must be an existing folder \(.* does not"):
        check_paths(cfg)
    (tmp_path / "moved").mkdir()
    with pytest.raises(LoongError, match=r"^precision\.fp8_table=.*: must be an existing file \(.* is a folder\)$"):
        check_paths(cfg)


def test_the_configuration_page_is_generated_from_the_schemas() -> None:
    """Fails when a schema changed and docs/configuration.md was not regenerated: run
    ``uv run python -m loong.core.config.docs docs/configuration.md``."""
    assert docs_main(["--check", str(DOCS)]) == 0
    page = DOCS.read_text()
    for cli in RUN_CONFIGS.names():
        assert f"### `{cli} train`" in page
    for key in ("train.steps", "parallel.dp_shard", "model.lora.rank", "data.text_drop_prob", "model.rope_scaling.factor"):
        assert f"| `{key}` |" in page, key
