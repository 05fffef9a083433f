"""The plugin registry: lookups, helpful errors, lazy entries (loong-llm's plugin: loong-llm's test_plugin.py)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from loong.core.errors import LoongError
from loong.core.registry import Registry, _Lazy


def test_register_and_get() -> None:
    reg: Registry = Registry("widget")

    @reg.register("alpha")
    class Alpha:
        pass

    beta = object()
    reg.add("beta", beta)
    assert reg.get("alpha") is Alpha
    assert reg.get("beta") is beta
    assert "alpha" in reg and "gamma" not in reg
    assert reg.names() == ["alpha", "beta"]
    assert list(reg) == ["alpha", "beta"]


def test_unknown_name_lists_known_names_and_the_closest() -> None:
    reg: Registry = Registry("widget")
    reg.add("alpha", 1)
    reg.add("beta", 2)
    with pytest.raises(LoongError) as err:
        reg.get("alpah")
    msg = str(err.value)
    assert "unknown widget 'alpah'" in msg
    assert "did you mean 'alpha'?" in msg
    assert "(known: alpha, beta)" in msg


def test_unknown_name_without_a_close_match_still_lists_known_names() -> None:
    reg: Registry = Registry("widget")
    reg.add("alpha", 1)
    with pytest.raises(LoongError) as err:
        reg.get("zzzzzz")
    assert "did you mean" not in str(err.value)
    assert "(known: alpha)" in str(err.value)


def test_unknown_name_in_an_empty_registry() -> None:
    with pytest.raises(LoongError, match=r"unknown widget 'x'.*\(none installed\)"):
        Registry("widget").get("x")


def test_duplicate_registration_of_a_different_object_fails() -> None:
    reg: Registry = Registry("widget")
    first, second = object(), object()
    reg.add("a", first)
    reg.add("a", first)  # the very same object again is fine (e.g. a module imported twice)
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        reg.add("a", second)
    with pytest.raises(ValueError):
        reg.register("a")(second)
    assert reg.get("a") is first


def test_add_lazy_does_not_replace_an_existing_entry() -> None:
    reg: Registry = Registry("widget")
    obj = object()
    reg.add("a", obj)
    reg.add_lazy("a", "json:dumps")
    assert reg.get("a") is obj


@pytest.fixture
def lazy_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Two throw-away modules: a registry holder, and a target that registers itself on import."""
    tag = uuid.uuid4().hex[:8]
    holder, target = f"_loong_reg_holder_{tag}", f"_loong_lazy_target_{tag}"
    (tmp_path / f"{holder}.py").write_text(
        "from loong.core.registry import Registry\nREG = Registry('widget')\n"
    )
    (tmp_path / f"{target}.py").write_text(
        textwrap.dedent(f"""
        from {holder} import REG

        @REG.register("self_registering")
        class SelfRegistering:
            pass

        class Plain:
            pass
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield holder, target
    for name in (holder, target):
        sys.modules.pop(name, None)


def test_lazy_entry_is_imported_only_on_get(lazy_modules: tuple[str, str]) -> None:
    holder, target = lazy_modules
    reg = importlib.import_module(holder).REG
    reg.add_lazy("plain", f"{target}:Plain")
    reg.add_lazy("self_registering", f"{target}:SelfRegistering")
    assert target not in sys.modules
    assert reg.names() == ["plain", "self_registering"]  # listing does not import
    assert "plain" in reg
    assert target not in sys.modules

    plain = reg.get("plain")
    assert target in sys.modules
    assert plain is sys.modules[target].Plain
    assert reg.get("plain") is plain  # cached, not re-resolved

    # The target's own @register ran on import and replaced the lazy entry without a "twice" error.
    assert reg.get("self_registering") is sys.modules[target].SelfRegistering
    assert not isinstance(reg._entries["self_registering"], _Lazy)


def test_lazy_entry_with_a_missing_target_fails_on_get_not_on_add() -> None:
    reg: Registry = Registry("widget")
    reg.add_lazy("ghost", "loong_no_such_module_xyz:Thing")
    with pytest.raises(ModuleNotFoundError):
        reg.get("ghost")
