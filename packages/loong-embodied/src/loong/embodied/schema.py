"""The run schema of ``loong-embodied train``: the core run config with typed ``model``, ``data`` and ``train``.

``model`` names a policy (``model.policy``, a :data:`~loong.embodied.policies.POLICIES` name) and one of its presets
(``model.preset``, a key of the policy's ``SPEC.presets``); ``model.config`` is a tagged section: its keys are
fields of *that* policy's config dataclass (``SPEC.config_class``), each overriding the preset, parsed and checked
by that dataclass's own annotations (:func:`loong.core.config.schema.from_dict`). A key the chosen policy does not
have fails with its dotted path and the policy's keys::

    loong-embodied train model.config.chunk_size=10 model.config.num_inference_steps=5
    loong-embodied train policy=groot_n1_7_tiny model.config.tune_llm=true

(the CLI passes ``model.config.*`` overrides to Hydra as ``++model.config.*``: the section holds no keys until one
is set). One section for every policy keeps the schema independent of which policies exist, so naming the
policies or checking a config imports the chosen policy's code only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from loong.core.config.checks import (
    KEEPS_RUN,
    Check,
    ExistingDir,
    NonEmptyStr,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)
from loong.core.config.schema import RunConfig, TrainConfig, from_dict, to_dict
from loong.core.errors import LoongError, did_you_mean

if TYPE_CHECKING:
    from loong.embodied.policies.base import PolicyConfig, PolicySpec

#: the keys of ``model`` itself; every other policy field goes under ``model.config``
MODEL_KEYS = ("policy", "preset", "config", "recompute", "init_from")


def policy_spec(name: str, path: str = "model.policy") -> PolicySpec:
    """The registered policy ``name`` (its SPEC is imported here), or a LoongError naming ``path`` and the known
    policies."""
    from loong.embodied.policies import POLICIES

    names = POLICIES.names()
    if name not in names:
        raise LoongError(f"{path}={name}: not a policy{did_you_mean(name, names)} (known: {', '.join(names)})")
    return POLICIES.get(name)


def policy_config(spec: PolicySpec, preset: str, overrides: dict[str, Any], path: str = "model") -> PolicyConfig:
    """Preset ``preset`` of ``spec`` with ``overrides`` (fields of ``spec.config_class``) applied, every override
    checked by the config class's annotations and the result by its ``validate`` (a LoongError names
    ``<path>.config.<key>``)."""
    if preset not in spec.presets:
        known = ", ".join(spec.presets)
        raise LoongError(f"{path}.preset={preset}: not a preset of model.policy={spec.name}"
                         f"{did_you_mean(preset, spec.presets)} (its presets: {known})")
    base = spec.presets[preset]
    names = [f.name for f in dataclasses.fields(spec.config_class)]
    for key in overrides:
        if key not in names:
            raise LoongError(f"unknown config key '{path}.config.{key}'{did_you_mean(str(key), names)}; "
                             f"model.policy={spec.name} ({spec.config_class.__name__}) has: {', '.join(names)}")
    # the whole preset goes through the class's checks with the overrides in place, so that checks across fields
    # see the values the run uses; the preset's own objects are kept for the fields not overridden
    checked = from_dict(spec.config_class, {**to_dict(base), **overrides}, f"{path}.config")
    return base.replace(**{key: getattr(checked, key) for key in overrides})


@dataclass
class PolicyModelConfig:
    """The policy of a run: ``policy`` (``pi05``, ``groot_n1_7``, ``groot_n1_6``) and its ``preset``; ``config``:
    fields of that policy's config dataclass overriding the preset (``model.config.chunk_size=10``; a field the
    policy lacks fails, listing its fields). ``recompute``: the fsdp engine's activation recomputation of
    ``policy.blocks()`` (``selective``: each block's MLP). ``init_from``: weights that start a fresh run: a Loong
    checkpoint (run, ``checkpoints`` or ``step_N`` folder) or a lerobot policy folder (``config.json`` +
    ``model.safetensors``, e.g. ``lerobot/pi05_base`` downloaded); its config must equal this one.
    """

    policy: Annotated[str, Check(nonempty=True, note="pi05, groot_n1_7, groot_n1_6")] = "pi05"
    preset: NonEmptyStr = "tiny"
    config: Annotated[dict[str, Any], Check(note="fields of model.policy's config, e.g. chunk_size")] = field(
        default_factory=dict)
    recompute: Literal["none", "full", "selective"] = "none"
    init_from: ExistingDir | None = None

    def spec(self) -> PolicySpec:
        """The policy's registry entry."""
        return policy_spec(self.policy)

    def policy_config(self) -> PolicyConfig:
        """The preset with ``config``'s overrides applied (checked)."""
        return policy_config(self.spec(), self.preset, self.config)

    def validate(self, path: str) -> None:
        policy_config(policy_spec(self.policy, f"{path}.policy"), self.preset, self.config, path)


@dataclass
class EmbodiedDataConfig:
    """What the policy trains on: LeRobotDataset v3 folders.

    ``repo_root``: one local LeRobotDataset folder or a list of them (a mix; null: the synthetic reach task's
    dataset, written on first use into ``<output_dir>/.cache``: ``synthetic_episodes`` expert episodes of seed
    ``synthetic_seed``, PNG frames or, ``synthetic_videos=true``, AV1 videos). ``weights``: one sampling weight per
    dataset of a mix (null: in proportion to their frames). ``cameras``: the camera feature keys to read
    (``observation.images.top``; null: every camera of the datasets). ``num_workers``: DataLoader processes
    decoding frames and running the policy's processor (0: in the training process). ``video_backend``: ``pyav``
    (its wheel bundles FFmpeg) or ``torchcodec`` (needs the system's FFmpeg). ``on_error``: a sample that cannot be
    read stops the run (``fail``) or is counted and replaced by the next readable frame of its dataset (``skip``;
    episodes missing files are left out). ``embodiment_ids``: per dataset of ``repo_root``, the id that picks the
    GR00T policies' per-embodiment encoders and decoder (null: a single dataset uses the policy's configured
    embodiment, a mix the datasets' positions 0, 1, ...; each below the policy's ``num_embodiments``).
    """

    repo_root: Annotated[str, Check(nonempty=True)] | Annotated[list[NonEmptyStr], Check(nonempty=True)] | None = None
    weights: Annotated[list[PositiveFloat], Check(nonempty=True)] | None = None
    cameras: Annotated[list[NonEmptyStr], Check(nonempty=True)] | None = None
    embodiment_ids: Annotated[list[NonNegativeInt], Check(nonempty=True)] | None = None
    num_workers: Annotated[int, Check(ge=0, note="0: in the training process"), KEEPS_RUN] = 0
    video_backend: Literal["pyav", "torchcodec"] = "pyav"
    on_error: Annotated[Literal["fail", "skip"], KEEPS_RUN] = "fail"
    synthetic_episodes: PositiveInt = 200
    synthetic_seed: NonNegativeInt = 0
    synthetic_videos: bool = False

    def roots(self) -> list[str] | None:
        """``repo_root`` as a list (None: the synthetic dataset)."""
        if self.repo_root is None:
            return None
        return [self.repo_root] if isinstance(self.repo_root, str) else list(self.repo_root)

    def validate(self, path: str) -> None:
        roots = self.roots()
        if self.weights is not None:
            n = len(roots) if roots is not None else 1
            if len(self.weights) != n:
                raise LoongError(f"{path}.weights={self.weights}: one weight per dataset of {path}.repo_root "
                                 f"({n} dataset{'s' if n > 1 else ''})")
        if self.embodiment_ids is not None:
            n = len(roots) if roots is not None else 1
            if len(self.embodiment_ids) != n:
                raise LoongError(f"{path}.embodiment_ids={self.embodiment_ids}: one id per dataset of "
                                 f"{path}.repo_root ({n} dataset{'s' if n > 1 else ''})")


@dataclass
class EmbodiedTrainConfig(TrainConfig):
    """The core schedule; ``save_lerobot``: after training, the trained policy (``train.export_ema``: its moving
    averages) as a lerobot policy folder ``<run>/lerobot/`` that lerobot's ``from_pretrained`` loads.
    ``save_lerobot_dataset``: for a policy trained on a mix (``data.repo_root`` a list), the dataset whose
    normalisation statistics and embodiment that folder carries (a lerobot folder holds one dataset's): its index in
    ``data.repo_root``, its folder or its folder name, as ``loong-embodied convert --dataset-index`` takes them
    (null: the first, with a log line listing the choices). A value that names none of the datasets stops the run
    before anything is written (the task's ``check_config``)."""

    # loong-embodied's name for the core's save_hf: one export, two spellings
    save_lerobot: Annotated[bool, KEEPS_RUN] = False
    save_lerobot_dataset: Annotated[int | str | None, Check(
        note="an index of data.repo_root, a dataset folder or its name; null: the first"), KEEPS_RUN] = None

    def validate(self, path: str) -> None:
        super().validate(path)
        self.save_hf = self.save_lerobot = self.save_hf or self.save_lerobot


@dataclass
class EmbodiedRunConfig(RunConfig):
    """``loong-embodied train`` config: a VLA policy on LeRobotDatasets, flow matching on the fsdp engine."""

    task: str = "embodied.vla"
    engine: str = "fsdp"
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    data: EmbodiedDataConfig = field(default_factory=EmbodiedDataConfig)  # type: ignore[assignment]
    train: EmbodiedTrainConfig = field(default_factory=EmbodiedTrainConfig)


def hydra_overrides(overrides: list[str]) -> list[str]:
    """The CLI's overrides as Hydra takes them: ``model.config.KEY=V`` (and ``model.config={...}``) become
    ``++model.config...`` (the tagged section is empty until a key is set, and Hydra adds keys only with
    ``+``/``++``); a policy field given directly under ``model`` (``model.chunk_size=10``) fails with where it
    belongs."""
    out = []
    for item in overrides:
        key = item.split("=", 1)[0]
        if key == "model.config" or key.startswith("model.config."):
            out.append("++" + item)
            continue
        bare = key.lstrip("+~")
        if bare.startswith("model.") and "=" in item and bare.split(".")[1] not in MODEL_KEYS:
            field_name = bare.split(".", 1)[1]
            raise LoongError(f"unknown config key '{bare}': model holds {', '.join(MODEL_KEYS)}; the policy's own "
                             f"fields go under model.config (model.config.{field_name}=...)")
        out.append(item)
    return out


__all__ = ["EmbodiedDataConfig", "EmbodiedRunConfig", "EmbodiedTrainConfig", "MODEL_KEYS", "PolicyModelConfig",
           "hydra_overrides", "policy_config", "policy_spec"]
