"""A trained policy at inference: load it from a run, then turn robot observations into robot actions.

:func:`load_policy` reads what a ``loong-embodied train`` run leaves behind (the run-directory contract)::

    <run_dir>/policy/policy.json          {"policy": <registry name>, "config": {<the policy config's fields>}}
    <run_dir>/policy/...                  the processor's files (PolicyProcessor.save: statistics, tokenizer, ...)
    <run_dir>/checkpoints/step_N/         the core's DCP checkpoint: the VLAPolicy's state dict under ``model.``,
                                          the moving averages (train.ema_decay) under ``ema.``
    <run_dir>/checkpoints/step_N/policy/  the same policy folder again, so that a step folder copied alone still
                                          loads (preferred when present)

``CKPT`` may name the run folder, its ``checkpoints`` folder (both: the newest step that verifies) or one step
folder. Only the model's tensors are read (no optimiser state), without a process group.

:class:`PolicyRunner` then serves one robot at a time. A *robot observation* is a flat dict in LeRobot's names:

- ``observation.images.<camera>``: ``uint8`` ``[h, w, 3]`` (or ``[3, h, w]``), or float in ``[0, 1]``;
- ``observation.state``: the state vector ``[state_dim]``;
- ``task``: the instruction (openpi's ``prompt``);
- optionally ``embodiment_id``: an int (GR00T's per-embodiment heads; default: the policy config's).

The cameras an observation must carry are the processor's ``camera_keys`` (every processor of the package
names them so, and its ``state_key``), all of them: a missing camera is an error, not a silently blank image.

It is batched into the raw-batch format of :func:`~loong.embodied.data.dataset.collate_vla` (cameras float
``[1, 3, h, w]`` in ``[0, 1]``, state ``[1, s]``, ``task`` a one-element list), run through the policy's
processor (``train=False``), its ``predict_action_chunk`` and ``processor.postprocess``, and comes back as robot
actions (unnormalised, ``[chunk_size, action_dim]`` float32). :meth:`PolicyRunner.infer` returns the whole chunk
(openpi's reply; the client executes as much of it as it wants), :meth:`PolicyRunner.act` one action at a time,
predicting again after ``n_action_steps`` actions (LeRobot's ``select_action``, used by closed-loop eval).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from loong.core.checkpoint import read_state, resolve_checkpoint
from loong.core.config.schema import from_dict
from loong.core.engines.fsdp.checkpoint import EMA_KEY, check_same_model
from loong.core.errors import LoongError
from loong.embodied.data.dataset import IMAGE_PREFIX
from loong.embodied.data.normalize import SOURCE_KEY
from loong.embodied.policies import POLICIES, PolicyConfig, PolicyProcessor, PolicySpec, VLAPolicy

#: where a run keeps what the processor and the policy's config need, beside ``checkpoints/``
POLICY_DIR = "policy"
POLICY_FILE = "policy.json"
STATE_KEY = "observation.state"
TASK_KEY = "task"
EMBODIMENT_KEY = "embodiment_id"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def pick_device(device: str = "auto") -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU; else ``cpu``, ``cuda``, ``cuda:N``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, ValueError):
        raise LoongError(f"--device {device!r}: one of auto, cpu, cuda, cuda:N") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise LoongError(f"--device {device}: no CUDA device here (use --device cpu)")
    if chosen.type not in ("cpu", "cuda"):
        raise LoongError(f"--device {device!r}: one of auto, cpu, cuda, cuda:N")
    return chosen


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA (what the policies train in), fp32 on the CPU; else ``fp32`` or ``bf16``."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise LoongError(f"--dtype {dtype!r}: one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class LoadedPolicy:
    """A trained policy ready for inference: the module (eval mode, no gradients, on ``device`` in ``dtype``),
    its processor and config, and where it came from."""

    name: str
    spec: PolicySpec
    config: PolicyConfig
    policy: VLAPolicy
    processor: PolicyProcessor
    step_dir: Path
    run_dir: Path
    step: int
    ema: bool
    device: torch.device
    dtype: torch.dtype


def read_policy_file(policy_dir: Path) -> tuple[PolicySpec, PolicyConfig]:
    """The registered policy and its config that ``policy_dir/policy.json`` names."""
    path = policy_dir / POLICY_FILE
    if not path.is_file():
        raise LoongError(f"{path}: not found; a loong-embodied run writes it beside checkpoints/ (is this the "
                         "checkpoint of another Loong package's run?)")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoongError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("policy"), str) or not isinstance(data.get("config"),
                                                                                                dict):
        raise LoongError(f"{path}: must hold {{\"policy\": NAME, \"config\": {{...}}}}, got {str(data)[:120]}")
    spec = POLICIES.get(data["policy"])
    config = from_dict(spec.config_class, data["config"], f"{path.name}:config")
    return spec, config


def weight_sources(step_dir: Path, expected: Mapping[str, torch.Tensor], ema: bool = False
                   ) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """Where each policy tensor (the keys of ``expected``, e.g. a meta-device state dict) is in the DCP checkpoint
    ``step_dir``, from its metadata alone: ``{key: (saved key, shape, saved dtype)}``, the saved key ``model.<key>``
    or, ``ema``, the moving average ``ema.<key>`` where the run kept one (a frozen parameter has none: its value is
    its own). A checkpoint of another model is refused naming the keys."""
    meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    shapes = {k: tuple(v.shape) for k, v in expected.items() if isinstance(v, torch.Tensor)}
    check_same_model(step_dir, expected, allow_missing=False)
    averaged = {k for k in shapes if f"{EMA_KEY}.{k}" in meta} if ema else set()
    if ema and not averaged:
        raise LoongError(f"{step_dir} holds no moving averages of the weights (its run had no "
                         "train.ema_decay); drop --ema to use the weights")
    saved = {k: f"{EMA_KEY}.{k}" if k in averaged else f"model.{k}" for k in shapes}
    return {k: (saved[k], shapes[k], meta[saved[k]].properties.dtype) for k in shapes}


def read_weights(step_dir: Path, expected: Mapping[str, torch.Tensor], ema: bool = False) -> dict[str, torch.Tensor]:
    """The policy's tensors from the DCP checkpoint ``step_dir`` (whole, on the host, in their saved dtype):
    every key of ``expected`` (the policy's state dict, e.g. on the meta device) under ``model.``; ``ema``: the
    moving averages ``ema.<key>`` where the run kept them (a frozen parameter has none: its value is its own)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for saved_key, shape, dtype in weight_sources(step_dir, expected, ema=ema).values():
        group, name = saved_key.split(".", 1)
        state.setdefault(group, {})[name] = torch.empty(shape, dtype=dtype)
    tensors = state.get("model", {})
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step_dir))  # in place, into the tensors above
    return {**tensors, **state.get(EMA_KEY, {})}


def _build(spec: PolicySpec, config: PolicyConfig, shell: VLAPolicy, state: Mapping[str, torch.Tensor],
           device: torch.device) -> VLAPolicy:
    """``spec``'s policy holding ``state``: the meta-device ``shell`` given the loaded tensors (no random init of
    a multi-billion-parameter model); a policy with buffers outside its state dict (computed in ``__init__``,
    e.g. rotary frequencies) is built for real on ``device`` and loaded by copy instead."""
    shell.load_state_dict(dict(state), strict=True, assign=True)
    if not any(t.is_meta for t in (*shell.parameters(), *shell.buffers())):
        return shell
    with torch.device(device):
        policy = spec.policy_class(config)
    policy.load_state_dict(dict(state), strict=True)
    return policy


def locate_policy(path: str | Path) -> tuple[PolicySpec, PolicyConfig, PolicyProcessor, Path, Path]:
    """``(spec, config, processor, step_dir, run_dir)`` of the run, checkpoints folder or step folder ``path`` (a
    folder: its newest verified step): everything :func:`load_policy` reads but the weights."""
    p = Path(path).expanduser()
    if not p.exists():
        raise LoongError(f"{path}: no such file or folder (CKPT is a loong-embodied run, its checkpoints/ folder "
                         "or one checkpoints/step_N folder)")
    runs = sorted(str(d.parent) for d in p.glob("*/checkpoints") if d.is_dir()) if p.is_dir() else []
    if runs and not (p / "checkpoints").is_dir() and not any(p.glob("step_*")):
        raise LoongError(f"{path} is an output folder, not a run; name one of its runs: {', '.join(runs)}")
    step_dir = resolve_checkpoint(p)
    # <run_dir>/checkpoints/step_N; a step folder copied elsewhere on its own: its parent
    run_dir = step_dir.parent.parent if step_dir.parent.name == "checkpoints" else step_dir.parent
    policy_dir = step_dir / POLICY_DIR if (step_dir / POLICY_DIR / POLICY_FILE).is_file() else run_dir / POLICY_DIR
    spec, config = read_policy_file(policy_dir)
    return spec, config, spec.processor_class.load(policy_dir, config), step_dir, run_dir


def load_policy(path: str | Path, *, ema: bool = False, device: str = "auto", dtype: str = "auto") -> LoadedPolicy:
    """The trained policy of the run, checkpoints folder or step folder ``path`` (a folder: its newest verified
    step). ``ema``: the moving averages of the weights instead of the weights; ``device`` / ``dtype``: see
    :func:`pick_device` / :func:`pick_dtype` (floating weights are cast to ``dtype``)."""
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    spec, config, processor, step_dir, run_dir = locate_policy(path)
    with torch.device("meta"):
        shell = spec.policy_class(config)
    state = read_weights(step_dir, shell.state_dict(), ema=ema)
    policy = _build(spec, config, shell, state, torch_device)
    policy.to(device=torch_device, dtype=torch_dtype)  # floating tensors only: ids and masks keep theirs
    policy.eval().requires_grad_(False)
    return LoadedPolicy(name=spec.name, spec=spec, config=config, policy=policy, processor=processor,
                        step_dir=step_dir, run_dir=run_dir, step=int(read_state(step_dir).get("step", -1)), ema=ema,
                        device=torch_device, dtype=torch_dtype)


def image_tensor(key: str, image: Any) -> torch.Tensor:
    """One camera image as ``[3, h, w]`` float32 in ``[0, 1]``: ``uint8`` is divided by 255, float is taken as
    it is; channel-last ``[h, w, 3]`` (gymnasium, LeRobot's envs) and channel-first ``[3, h, w]`` (openpi's
    ALOHA client) are both accepted."""
    array = np.asarray(image)
    if array.ndim != 3 or 3 not in (array.shape[0], array.shape[-1]):
        raise LoongError(f"{key}: a camera image is [h, w, 3] or [3, h, w], got shape {list(array.shape)}")
    if array.dtype == np.uint8:  # copies: a message's arrays are read-only views of it
        tensor = torch.from_numpy(np.array(array, dtype=np.float32)).div_(255)
    elif np.issubdtype(array.dtype, np.floating):
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))
    else:
        raise LoongError(f"{key}: a camera image is uint8 (0..255) or float (0..1), got {array.dtype}")
    if array.shape[-1] == 3 and array.shape[0] != 3:
        tensor = tensor.permute(2, 0, 1)
    return tensor.contiguous()


def expected_cameras(processor: PolicyProcessor) -> list[str] | None:
    """The camera keys the processor reads (its ``camera_keys``), or None when it does not say."""
    keys = getattr(processor, "camera_keys", None)
    return None if keys is None else list(keys)


def resolve_dataset(records: Sequence[Mapping[str, Any]], source: int | str | None, what: str = "source",
                    of: str = "the policy's") -> int:
    """The dataset index that ``source`` names among ``records``, a mix's datasets in order (each with its ``root``
    and ``name``, as ``sources.json`` holds them; empty: one dataset, no names): an index, a dataset folder or its
    name; None: 0, the first dataset. ``what`` names the option (or ``key=value``) in errors, ``of`` whose datasets
    these are. The one resolution of ``convert --dataset-index``, ``eval`` / ``serve --source`` and
    ``train.save_lerobot_dataset``."""
    if source is None:
        return 0
    n = max(len(records), 1)
    known = ", ".join(f"{i}: {r.get('name')}" for i, r in enumerate(records))
    if isinstance(source, int) or (isinstance(source, str) and source.isdigit()):
        index = int(source)
        if not 0 <= index < n:
            raise LoongError(f"{what}: {index} is not one of {of} {n} dataset(s) ({known or f'0..{n - 1}'})")
        return index
    for i, record in enumerate(records):
        if source in (record.get("root"), record.get("name")) or (
                record.get("root") and Path(str(source)).expanduser().resolve() == Path(record["root"])):
            return i
    raise LoongError(f"{what}: {source!r} names none of {of} datasets ({known or 'one dataset, no names recorded'})")


def resolve_source(processor: Any, source: int | str | None, what: str = "source") -> int:
    """The dataset index that ``source`` names in a mix-trained processor's sources (:func:`resolve_dataset`: an
    index, a dataset folder or its name; None: 0, the first dataset); ``what`` names the option in errors."""
    return resolve_dataset(getattr(processor, "sources", None) or [], source, what)


class PolicyRunner:
    """Robot observations in, robot actions out, for one robot (see the module docstring for the formats).

    ``seed``: the flow-matching noise is drawn from a generator of this seed (re-seeded by :meth:`reset`), so
    the same observations give the same actions; None draws from torch's global generator. ``n_action_steps``:
    how many actions of a chunk :meth:`act` executes before predicting again (default: the config's).
    ``default_task``: the instruction when an observation has none.
    """

    def __init__(self, loaded: LoadedPolicy, *, seed: int | None = 0, n_action_steps: int | None = None,
                 default_task: str | None = None, source: int | str | None = None) -> None:
        self.loaded = loaded
        self.source = resolve_source(loaded.processor, source)
        self.config = loaded.config
        steps = self.config.n_action_steps if n_action_steps is None else n_action_steps
        if not isinstance(steps, int) or not 1 <= steps <= self.config.chunk_size:
            raise LoongError(f"n_action_steps: must be 1..chunk_size ({self.config.chunk_size}), got {steps!r}")
        self.n_action_steps = steps
        self.default_task = default_task
        self.cameras = expected_cameras(loaded.processor)
        self.state_key = str(getattr(loaded.processor, "state_key", STATE_KEY))
        self._seed = seed
        self._generator: torch.Generator | None = None
        self._queue: deque[np.ndarray] = deque()
        self.reset(seed)

    def reset(self, seed: int | None = None) -> None:
        """Start an episode: forget queued actions; ``seed`` re-seeds the noise (None: keep the runner's)."""
        self._queue.clear()
        self.loaded.policy.reset()
        if seed is not None:
            self._seed = seed
        self._generator = None if self._seed is None else torch.Generator().manual_seed(self._seed)

    def raw_batch(self, observation: Mapping[str, Any]) -> dict[str, Any]:
        """One robot observation as a batch of one in :func:`collate_vla`'s format (no ``action``)."""
        cameras = [k for k in observation if k.startswith(IMAGE_PREFIX)]
        if self.cameras is not None:
            missing = [k for k in self.cameras if k not in observation]
            if missing:
                raise LoongError(f"observation: no {', '.join(missing)} (the policy reads the cameras "
                                 f"{', '.join(self.cameras)}; got {', '.join(sorted(observation)) or 'nothing'})")
            cameras = self.cameras
        state_key = self.state_key if self.state_key in observation else STATE_KEY
        if state_key not in observation:
            raise LoongError(f"observation: no {self.state_key} (got {', '.join(sorted(observation)) or 'nothing'})")
        state = np.array(observation[state_key], dtype=np.float32)
        if state.ndim != 1:
            raise LoongError(f"{state_key}: a state vector [state_dim], got shape {list(state.shape)}")
        task = observation.get(TASK_KEY, self.default_task)
        if isinstance(task, bytes):
            task = task.decode()
        if not isinstance(task, str):
            raise LoongError(f"observation: no {TASK_KEY} (the instruction; openpi clients send it as 'prompt'), "
                             "and no default task was given")
        batch: dict[str, Any] = {key: image_tensor(key, observation[key])[None] for key in cameras}
        batch[self.state_key] = torch.from_numpy(state)[None]
        batch[TASK_KEY] = [task]
        if self.source:  # a mix's policy: the source's statistics and embodiment (0 needs no key)
            batch[SOURCE_KEY] = torch.tensor([self.source], dtype=torch.long)
        if observation.get(EMBODIMENT_KEY) is not None:
            try:
                batch[EMBODIMENT_KEY] = torch.tensor([int(observation[EMBODIMENT_KEY])], dtype=torch.long)
            except (TypeError, ValueError):
                raise LoongError(f"{EMBODIMENT_KEY}: an int, got {observation[EMBODIMENT_KEY]!r}") from None
        return batch

    def _noise(self) -> torch.Tensor | None:
        if self._generator is None:
            return None
        shape = (1, self.config.chunk_size, self.config.max_action_dim)
        return torch.randn(shape, generator=self._generator).to(self.loaded.device)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.loaded.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.loaded.device.type, dtype=self.loaded.dtype)

    @torch.inference_mode()
    def predict_chunk(self, observation: Mapping[str, Any]) -> np.ndarray:
        """``[chunk_size, action_dim]`` float32 robot actions for ``observation``."""
        inputs = self.loaded.processor(self.raw_batch(observation), train=False)
        device = self.loaded.device
        inputs = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        with self._autocast():
            chunk = self.loaded.policy.predict_action_chunk(inputs, noise=self._noise())
        processor = self.loaded.processor
        actions = (processor.postprocess(chunk.float().cpu(), source=self.source) if self.source
                   else processor.postprocess(chunk.float().cpu()))
        return actions[0].float().numpy()

    def infer(self, observation: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """``{"actions": [chunk_size, action_dim]}``: a whole chunk, as openpi's policies answer."""
        return {"actions": self.predict_chunk(observation)}

    def act(self, observation: Mapping[str, Any]) -> np.ndarray:
        """The next ``[action_dim]`` action: a chunk is predicted when the queue is empty, and its first
        ``n_action_steps`` actions are executed in turn."""
        if not self._queue:
            self._queue.extend(self.predict_chunk(observation)[: self.n_action_steps])
        return self._queue.popleft()

    def metadata(self) -> dict[str, Any]:
        """What a client may want to know about the policy (the serve command sends it on connect)."""
        loaded = self.loaded
        return {
            "policy": loaded.name, "step": loaded.step, "ema": loaded.ema, "checkpoint": str(loaded.step_dir),
            "cameras": self.cameras, "state_key": self.state_key,
            "state_dim": getattr(loaded.processor, "state_dim", None),
            "action_dim": getattr(loaded.processor, "action_dim", None),
            "chunk_size": self.config.chunk_size, "n_action_steps": self.n_action_steps, "source": self.source,
            "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
        }


def env_observation(observation: Mapping[str, Any], task: str | None = None) -> dict[str, Any]:
    """A gymnasium observation in LeRobot's gym layout as a robot observation: ``pixels`` (a dict of cameras,
    or one image: ``observation.image``) → ``observation.images.<camera>``, ``agent_pos`` →
    ``observation.state``, ``environment_state`` → ``observation.environment_state`` (LeRobot's
    ``preprocess_observation`` names), plus ``task``."""
    out: dict[str, Any] = {}
    pixels = observation.get("pixels")
    if isinstance(pixels, Mapping):
        out.update({f"{IMAGE_PREFIX}{camera}": image for camera, image in pixels.items()})
    elif pixels is not None:
        out["observation.image"] = pixels
    if "agent_pos" in observation:
        out[STATE_KEY] = observation["agent_pos"]
    if "environment_state" in observation:
        out["observation.environment_state"] = observation["environment_state"]
    if task is not None:
        out[TASK_KEY] = task
    return out


__all__ = ["DTYPES", "POLICY_DIR", "POLICY_FILE", "LoadedPolicy", "PolicyRunner", "env_observation",
           "expected_cameras", "image_tensor", "load_policy", "locate_policy", "pick_device", "pick_dtype",
           "read_policy_file", "read_weights", "resolve_dataset", "resolve_source", "weight_sources"]
