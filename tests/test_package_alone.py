"""Each modality package alone: its wheel, with only its declared dependencies, in a fresh venv outside the repository.

The wheels are the session's ``uv build --package <name> --wheel`` (tests/conftest.py). Sibling Loong packages come
only from those wheels (``--find-links``; the installed versions are checked against them); everything else
resolves normally (uv's cache first, PyPI for what it lacks). In each venv: the CLI's ``--help``, its embedded
default for a few steps, ``loong env``; and what the venv must *not* hold, from ARCHITECTURE.md's arrows.
Then a second modality is added to a venv holding the first (both orders): its commands and registry entries
appear, and the first's ``--help`` and registry entries do not change.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def uv() -> str:
    """The uv executable (the session's ``UV``, else the first on PATH); conftest.py builds the wheels with it."""
    found = os.environ.get("UV") or shutil.which("uv")
    assert found, "uv is not on PATH: this test installs with it"
    return found

#: the distributions each modality's venv must not contain (ARCHITECTURE.md, "Dependency direction")
FORBIDDEN = {
    "loong-core": {"loong-llm", "loong-vlm", "loong-diffusion", "loong-embodied", "loong-xpu",
                   "diffusers", "lerobot", "megatron-core"},
    "loong-llm": {"loong-vlm", "loong-diffusion", "loong-embodied", "diffusers", "lerobot"},
    "loong-vlm": {"loong-diffusion", "loong-embodied", "diffusers", "lerobot"},
    "loong-diffusion": {"loong-llm", "loong-vlm", "loong-embodied", "lerobot", "megatron-core"},
    "loong-embodied": {"loong-llm", "loong-vlm", "loong-diffusion", "diffusers", "megatron-core"},
}
#: what each must contain besides itself (its engine's library, its field's library)
REQUIRED = {
    "loong-core": {"loong-kernels", "torch"},
    "loong-llm": {"loong-core", "loong-kernels", "megatron-core", "transformers"},
    "loong-vlm": {"loong-llm", "loong-core", "loong-kernels", "megatron-core", "transformers"},
    "loong-diffusion": {"loong-core", "loong-kernels", "diffusers"},
    "loong-embodied": {"loong-core", "loong-kernels", "lerobot", "transformers"},
}
#: the cheapest run of each embedded default (the knobs tests/test_one_trainer.py uses, fewer steps)
TRAIN = ["train", "train.steps=2", "train.global_batch_size=2", "train.micro_batch_size=1", "train.save_interval=2",
         "train.log_interval=1", "train.eval_interval=0", "train.eval_iters=0", "train.progress=false"]
TRAIN_EXTRA = {"loong-llm": ["train.seq_length=32"], "loong-embodied": ["data.synthetic_episodes=20"]}
#: prints the registry's entries once every installed plugin is loaded
REGISTRY_SNAPSHOT = (
    "import json; from loong.core import registry as r; r.load_plugins(); "
    "print(json.dumps({k: sorted(getattr(r, k).names()) for k in ('MODELS', 'TASKS', 'ENGINES', 'CONFIG_DIRS', "
    "'RUN_CONFIGS')}))"
)


def clean_env() -> dict[str, str]:
    """This process's environment without what would tie a child to the repository or to a distributed job."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
            "MASTER_PORT", "LOONG_SINGLE_PROCESS", "LOONG_ACCELERATOR", "PYTHONDONTWRITEBYTECODE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["HF_HUB_OFFLINE"] = "1"
    # CI's UV_COMPILE_BYTECODE=1 would compile all of torch at each of the seven installs; instead each venv's
    # first import of a module writes its .pyc (PYTHONDONTWRITEBYTECODE dropped above) and later processes reuse it
    env["UV_COMPILE_BYTECODE"] = "0"
    return env


@dataclass
class Venv:
    """A fresh venv outside the repository and what was installed into it."""

    path: Path

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def run(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` (a console script of the venv, or its python) in the venv's folder, not the repository."""
        exe = self.bin(argv[0])
        return subprocess.run([exe, *argv[1:]], cwd=self.path.parent, env=clean_env(), capture_output=True,
                              text=True, timeout=timeout)

    def install(self, wheel: Path) -> None:
        """Installs ``wheel`` and its declared dependencies; Loong siblings from the wheel folder only.

        uv caches a ``--find-links`` wheel by folder and file name, and pytest reuses its numbered temporary folders
        across sessions, so without ``--refresh-package`` an earlier session's same-named sibling wheel (another
        commit's code under the same dev version) would be installed instead of this session's build.
        """
        refresh = [arg for w in sorted(wheel.parent.glob("loong_*.whl"))
                   for arg in ("--refresh-package", w.name.split("-")[0].replace("_", "-"))]
        subprocess.run([uv(), "pip", "install", "-q", "--python", self.bin("python"), "--find-links",
                        str(wheel.parent), *refresh, "--link-mode", "hardlink", str(wheel)],
                       check=True, env=clean_env(), cwd=self.path.parent, timeout=600)

    def distributions(self) -> dict[str, str]:
        """name -> version of every distribution installed in the venv."""
        out = subprocess.run([uv(), "pip", "list", "--format", "json", "--python", self.bin("python")],
                             check=True, env=clean_env(), capture_output=True, text=True).stdout
        return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)}

    def registry(self) -> dict[str, list[str]]:
        proc = self.run("python", "-c", REGISTRY_SNAPSHOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])


def make_venv(where: Path) -> Venv:
    assert not where.resolve().is_relative_to(ROOT), f"{where} is inside the repository"
    subprocess.run([uv(), "venv", "-q", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", str(where)],
                   check=True, env=clean_env(), cwd=where.parent)
    return Venv(where)


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


@pytest.fixture(scope="module", params=sorted(FORBIDDEN))
def alone(request: pytest.FixtureRequest, built_wheels: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Venv, dict[str, str]]:
    """(package, its venv, the distributions its wheel pulled in)."""
    pkg = request.param
    venv = make_venv(tmp_path_factory.mktemp(f"alone-{pkg}") / "venv")
    venv.install(built_wheels[pkg])
    dists = venv.distributions()
    # the closing note of issue 24 shows this list: what each wheel pulled in
    print(f"\n{pkg} pulled in {len(dists)} distributions: " + ", ".join(f"{k}=={v}" for k, v in sorted(dists.items())))
    return pkg, venv, dists


def test_installs_only_what_the_arrows_allow(alone: tuple[str, Venv, dict[str, str]],
                                             built_wheels: dict[str, Path]) -> None:
    pkg, _, dists = alone
    present = FORBIDDEN[pkg] & set(dists)
    assert not present, f"{pkg}'s wheel pulled in {sorted(present)}"
    missing = (REQUIRED[pkg] | {pkg}) - set(dists)
    assert not missing, f"{pkg}'s venv lacks {sorted(missing)}"
    # every Loong distribution there is the session's freshly built wheel, not one from an index
    for name in (n for n in dists if n.startswith("loong-")):
        assert dists[name] == wheel_version(built_wheels[name]), (name, dists[name], built_wheels[name].name)


def test_cli_help_train_and_env(alone: tuple[str, Venv, dict[str, str]], built_wheels: dict[str, Path]) -> None:
    pkg, venv, _ = alone
    cli = "loong" if pkg == "loong-core" else pkg
    help_ = venv.run(cli, "--help")
    assert help_.returncode == 0 and "usage" in help_.stdout.lower(), help_.stdout + help_.stderr
    env = venv.run("loong", "env", "--json")
    assert env.returncode == 0, env.stderr[-3000:]
    listed = json.loads(env.stdout[env.stdout.index("{"):])["loong"]
    assert listed.get(pkg, "").split()[0] == wheel_version(built_wheels[pkg]), listed
    if pkg == "loong-core":
        return  # the core alone has no embedded default to train: that is every modality's
    out = venv.path.parent / "out"
    train = venv.run(cli, *TRAIN, *TRAIN_EXTRA.get(pkg, []), f"output_dir={out}", "run_name=alone")
    assert train.returncode == 0, (train.stdout + train.stderr)[-4000:]
    assert (out / "alone" / "checkpoints" / "step_00000002").is_dir(), sorted(p.name for p in (out / "alone").iterdir())


@pytest.mark.parametrize("first,second", [("loong-diffusion", "loong-embodied"), ("loong-embodied", "loong-diffusion")])
def test_a_second_modality_adds_and_changes_nothing(first: str, second: str, built_wheels: dict[str, Path],
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """The two fsdp modalities: disjoint field libraries (diffusers / lerobot), neither needs megatron-core."""
    venv = make_venv(tmp_path_factory.mktemp(f"{first}-then-{second}") / "venv")
    venv.install(built_wheels[first])
    help_before, registry_before = venv.run(first, "--help").stdout, venv.registry()
    venv.install(built_wheels[second])
    help_after, registry_after = venv.run(first, "--help").stdout, venv.registry()
    assert help_after == help_before, f"{first} --help changed once {second} was installed"
    for kind, names in registry_before.items():
        assert set(names) <= set(registry_after[kind]), f"{kind}: installing {second} removed {set(names) - set(registry_after[kind])}"
    added = {k: sorted(set(v) - set(registry_before[k])) for k, v in registry_after.items()}
    assert added["TASKS"] and added["RUN_CONFIGS"], f"{second} registered nothing: {added}"
    second_help = venv.run(second, "--help")
    assert second_help.returncode == 0, second_help.stderr[-3000:]
    env = venv.run("loong", "env", "--json")
    listed = json.loads(env.stdout[env.stdout.index("{"):])["loong"]
    assert first in listed and second in listed, listed
