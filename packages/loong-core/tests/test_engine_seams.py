"""The engine seam: megatron-core stays inside the megatron engine, each engine refuses the other's keys, a task
runs only on its engine, and an fsdp run never imports megatron-core."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loong.core.errors import LoongError

SRC = Path(__file__).parents[1] / "src" / "loong" / "core"
ALLOWED = (SRC / "engines" / "megatron", SRC / "accelerators" / "megatron_cpu.py")
WORKERS = Path(__file__).parent / "workers"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_megatron_core_is_imported_only_by_the_megatron_engine() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        if any(path == a or a in path.parents for a in ALLOWED):
            continue
        used = {n for n in _imports(path) if n.split(".")[0] == "megatron"}
        # the engine-neutral code may name the megatron engine's package only lazily, by registry string
        used |= {n for n in _imports(path) if n.startswith("loong.core.engines.megatron")}
        if used:
            offenders.append(f"{path.relative_to(SRC)}: {sorted(used)}")
    assert offenders == []


def test_loong_core_requires_megatron_only_through_its_extra() -> None:
    from importlib.metadata import requires

    reqs = requires("loong-core") or []
    megatron = [r for r in reqs if r.startswith("megatron-core")]
    assert megatron and all("extra == 'megatron'" in r.replace('"', "'") for r in megatron), megatron
    # that loong-llm and loong-vlm take the extra: tests/test_dependency_arrows.py (this package's tests see only it)


def test_an_fsdp_run_never_imports_megatron(tmp_path: Path) -> None:
    code = f"""
import sys
sys.path.insert(0, {str(WORKERS)!r})
from toy_tasks import toy_config
from loong.core.run import run
run(toy_config(task="toy.dit", output_dir={str(tmp_path)!r}, train={{"steps": 2}}), echo=lambda _m: None)
leaked = sorted(m for m in sys.modules if m.split(".")[0] == "megatron")
assert not leaked, leaked
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOONG_SINGLE_PROCESS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _toy(**sections):  # noqa: ANN003, ANN202
    sys.path.insert(0, str(WORKERS))
    from toy_tasks import toy_config

    return toy_config(**sections)


@pytest.mark.parametrize("sections,message", [
    ({"parallel": {"tp": 2}}, r"parallel.tp=2: the fsdp engine has no tensor"),
    ({"parallel": {"fsdp": "full", "dp_replicate": 2}}, r"parallel.dp_replicate=2 with parallel.fsdp=full"),
    ({"parallel": {"fsdp": "none", "dp_shard": 2}}, r"parallel.dp_shard=2 with parallel.fsdp=none"),
    ({"parallel": {"cp": 4, "cp_ulysses": 2, "cp_ring": 1}}, r"parallel.cp=4 is not parallel.cp_ulysses x"),
    ({"parallel": {"fsdp": "none", "fsdp_cpu_offload": True}}, r"fsdp_cpu_offload=true needs sharding"),
    ({"train": {"distributed_optimizer": True}}, r"train.distributed_optimizer: a megatron engine option"),
    ({"precision": {"fp8": "tensorwise"}, "train": {"precision": "bf16"}}, r"precision.fp8=tensorwise needs hardware FP8"),
    ({"model": {"recompute": "some"}}, r"model.recompute: 'some' is not one of"),
    ({"engine": "megatron"}, r"runs on the 'fsdp' engine, not 'megatron'"),
])  # fmt: skip
def test_bad_fsdp_configs_fail_before_anything_runs(tmp_path: Path, sections: dict, message: str) -> None:
    from loong.core.run import run

    cfg = _toy(output_dir=str(tmp_path), **sections)
    with pytest.raises(LoongError, match=message):
        run(cfg, echo=lambda _m: None)
    assert not any(tmp_path.iterdir())  # nothing written


def test_world_sizes_that_do_not_fit_the_mesh() -> None:
    from loong.core.config.schema import ParallelConfig
    from loong.core.engines.fsdp.mesh import check_parallel, mesh_sizes

    def sizes(world: int, **kw):  # noqa: ANN003, ANN202
        p = ParallelConfig(**kw)
        check_parallel(p)
        return mesh_sizes(p, world)

    assert sizes(8) == (1, 8)
    assert sizes(8, fsdp="hybrid", dp_replicate=2) == (2, 4)
    assert sizes(8, fsdp="hybrid", dp_shard=2, cp_ring=2) == (2, 2)
    assert sizes(8, fsdp="none", cp=2) == (4, 1)
    with pytest.raises(LoongError, match="not divisible by parallel.cp=3"):
        sizes(8, cp=3)
    with pytest.raises(LoongError, match="give parallel.dp_replicate"):
        sizes(8, fsdp="hybrid")
    with pytest.raises(LoongError, match="does not make the 8 data-parallel ranks"):
        sizes(8, fsdp="hybrid", dp_replicate=3)


def test_the_megatron_engine_refuses_fsdp_keys() -> None:
    from loong.core.config.schema import RunConfig
    from loong.core.engines.megatron.engine import MegatronEngine

    cfg = RunConfig()
    cfg.train.compile = True
    with pytest.raises(LoongError, match=r"train.compile=True: an fsdp engine option"):
        MegatronEngine.check_config(cfg)
