"""``loong-embodied serve CKPT --port N``: a policy server that openpi's robot clients connect to as they are.

The protocol is the one of openpi's ``openpi_client.websocket_client_policy.WebsocketClientPolicy`` (PyPI
``openpi-client``) and openpi's ``WebsocketPolicyServer``:

- one websocket per client, no compression, no message size limit; ``GET /healthz`` answers ``200 OK``;
- on connect the server sends its metadata (a msgpack map);
- then each binary message from the client is one observation (a msgpack map, possibly nested), answered by one
  binary message: ``{"actions": float32 [chunk_size, action_dim], "server_timing": {"infer_ms": ..,
  "prev_total_ms": ..}}``; the client executes as many of the chunk's actions as it likes (openpi's
  ``ActionChunkBroker``) before asking again;
- a failure is answered by a text frame (the error; the client raises it) and the connection is closed with
  code 1011.

Arrays travel as openpi's msgpack-numpy encodes them: an ``ndarray`` is the map ``{b"__ndarray__": True,
b"data": <raw bytes>, b"dtype": <dtype.str, e.g. "|u1", "<f4">, b"shape": [...]}`` and a numpy scalar
``{b"__npgeneric__": True, b"data": <item>, b"dtype": <dtype.str>}`` (object, void and complex arrays are refused,
so nothing is ever unpickled).

**The key map.** A client's observation is flattened with ``/`` (openpi's own convention: ALOHA's
``{"images": {"cam_high": ...}}`` is ``images/cam_high``) and each key is mapped to the policy's names (see
:mod:`loong.embodied.inference`): first the explicit entries, ``"client key": "policy key"`` (``--map`` /
``--key-map FILE.json``), then :data:`DEFAULT_KEY_MAP`; a pattern ending in ``*`` maps a whole family (``images/*``
→ ``observation.images.*``); keys already in the policy's names pass through and everything else is ignored.
Several client keys mapped to ``observation.state`` are concatenated in the map's order (DROID's
``observation/joint_position`` then ``observation/gripper_position``). E.g. openpi's LIBERO client::

    loong-embodied serve RUN --map observation/image=observation.images.top \\
        --map observation/wrist_image=observation.images.wrist
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from loong.core.errors import LoongError
from loong.embodied.data.dataset import IMAGE_PREFIX
from loong.embodied.inference import EMBODIMENT_KEY, STATE_KEY, TASK_KEY, PolicyRunner

logger = logging.getLogger(__name__)

#: client key (or ``prefix*`` family) -> policy key, applied after the explicit entries: openpi's usual names
DEFAULT_KEY_MAP: dict[str, str] = {
    "prompt": TASK_KEY,
    "state": STATE_KEY,
    "observation/state": STATE_KEY,
    "images/*": IMAGE_PREFIX + "*",
    "observation/images/*": IMAGE_PREFIX + "*",
}


# --- openpi's msgpack-numpy encoding ----------------------------------------------------------------------------

def _encode(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in "VOc":
        raise TypeError(f"msgpack-numpy: arrays of dtype {obj.dtype} are not sent")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"msgpack-numpy: cannot send a {type(obj).__name__}")


def _decode(obj: dict[Any, Any]) -> Any:
    if b"__ndarray__" in obj:
        dtype = np.dtype(obj[b"dtype"])
        if dtype.kind in "VOc":
            raise ValueError(f"msgpack-numpy: arrays of dtype {dtype} are not accepted")
        return np.frombuffer(obj[b"data"], dtype=dtype).reshape(obj[b"shape"])
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


def packb(obj: Any) -> bytes:
    """``obj`` (maps, lists, numbers, strings, numpy arrays and scalars) in openpi's msgpack-numpy encoding."""
    return msgpack.packb(obj, default=_encode)


def unpackb(data: bytes) -> Any:
    """The inverse of :func:`packb` (arrays come back read-only, viewing the message)."""
    return msgpack.unpackb(data, object_hook=_decode)


# --- observation keys --------------------------------------------------------------------------------------------

def flatten(observation: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested maps as one map with ``/``-joined keys (``{"images": {"cam_high": x}}`` -> ``images/cam_high``)."""
    out: dict[str, Any] = {}
    for key, value in observation.items():
        name = f"{prefix}{key.decode() if isinstance(key, bytes) else key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def _is_policy_key(key: str) -> bool:
    # embodiment_id: GR00T's per-embodiment heads, per request (PolicyRunner reads it; default: the trained one's)
    return (key.startswith(IMAGE_PREFIX) or key in (STATE_KEY, TASK_KEY, EMBODIMENT_KEY)
            or key.startswith("observation."))


class KeyMap:
    """Client observation keys -> the policy's (see the module docstring); ``entries`` come before
    :data:`DEFAULT_KEY_MAP` (``use_defaults=False``: entries only)."""

    def __init__(self, entries: Mapping[str, str] | None = None, *, use_defaults: bool = True) -> None:
        self.entries: dict[str, str] = dict(entries or {})
        for source, target in self.entries.items():
            if not isinstance(source, str) or not isinstance(target, str) or not source or not target:
                raise LoongError(f"key map: {source!r}: {target!r} must map a client key to a policy key (strings)")
            if source.endswith("*") != target.endswith("*"):
                raise LoongError(f"key map: {source!r}: {target!r}: a family (ending in *) maps to a family")
            if not _is_policy_key(target.rstrip("*") if target.endswith("*") else target):
                raise LoongError(f"key map: {source!r} -> {target!r}: the policy's keys are "
                                 f"{IMAGE_PREFIX}<camera>, {STATE_KEY} and {TASK_KEY}")
        self.rules = {**self.entries, **({k: v for k, v in DEFAULT_KEY_MAP.items() if k not in self.entries}
                                         if use_defaults else {})}

    def target(self, key: str) -> str | None:
        """The policy key of client key ``key`` (None: ignored)."""
        for source, target in self.rules.items():
            if source.endswith("*"):
                if key.startswith(source[:-1]) and len(key) > len(source) - 1:
                    return target[:-1] + key[len(source) - 1:]
            elif key == source:
                return target
        return key if _is_policy_key(key) else None

    def apply(self, observation: Mapping[str, Any]) -> dict[str, Any]:
        """A client observation as a robot observation (states concatenated in the map's order)."""
        flat = flatten(observation)
        out: dict[str, Any] = {}
        states: list[tuple[int, str, Any]] = []
        order = list(self.rules)
        for key, value in flat.items():
            target = self.target(key)
            if target is None:
                continue
            if target == STATE_KEY:
                rank = next((i for i, s in enumerate(order) if s == key or (s.endswith("*") and key.startswith(
                    s[:-1]))), len(order))
                states.append((rank, key, value))
            elif target in out:
                raise LoongError(f"observation: {key!r} and another key both map to {target!r}")
            else:
                out[target] = value
        if states:
            parts = [np.atleast_1d(np.asarray(v, dtype=np.float32)).reshape(-1) for _, _, v in sorted(states)]
            out[STATE_KEY] = np.concatenate(parts)
        if isinstance(out.get(EMBODIMENT_KEY), np.ndarray):  # a numpy scalar from msgpack-numpy clients
            out[EMBODIMENT_KEY] = out[EMBODIMENT_KEY].item()
        if isinstance(out.get(TASK_KEY), np.ndarray):  # some clients send the prompt as a numpy string
            out[TASK_KEY] = str(out[TASK_KEY].item() if out[TASK_KEY].ndim == 0 else out[TASK_KEY])
        return out

    def describe(self) -> dict[str, str]:
        """The rules in the order they apply (sent in the metadata)."""
        return dict(self.rules)


def read_key_map(path: str | Path | None, pairs: list[str] | None = None) -> dict[str, str]:
    """The explicit entries of ``--key-map FILE.json`` (a JSON object) and ``--map SRC=DST`` (later win)."""
    entries: dict[str, str] = {}
    if path is not None:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LoongError(f"--key-map {path}: not a readable JSON object ({exc})") from None
        if not isinstance(data, dict):
            raise LoongError(f"--key-map {path}: must be a JSON object {{\"client key\": \"policy key\"}}")
        entries.update(data)
    for pair in pairs or []:
        source, eq, target = pair.partition("=")
        if not eq or not source or not target:
            raise LoongError(f"--map {pair!r}: must be CLIENT_KEY=POLICY_KEY, e.g. "
                             "observation/image=observation.images.top")
        entries[source] = target
    return entries


# --- the server --------------------------------------------------------------------------------------------------

class PolicyServer:
    """Serves ``runner`` to openpi clients on ``host:port`` (port 0: any free one, in :attr:`port` once
    started). One observation is answered at a time; every new connection resets the runner (re-seeds its
    noise), so a client's session does not depend on earlier ones."""

    def __init__(self, runner: PolicyRunner, *, host: str = "0.0.0.0", port: int = 8000,
                 key_map: KeyMap | None = None, metadata: Mapping[str, Any] | None = None) -> None:
        self.runner = runner
        self.host, self.port = host, port
        self.key_map = key_map or KeyMap()
        self.metadata = {**runner.metadata(), "key_map": self.key_map.describe(), **(metadata or {})}
        self.ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def infer(self, observation: Mapping[str, Any]) -> dict[str, Any]:
        """One client observation's answer (without the timing)."""
        return self.runner.infer(self.key_map.apply(observation))

    async def _handle(self, websocket: Any) -> None:
        import websockets

        logger.info("connection from %s", websocket.remote_address)
        self.runner.reset()
        await websocket.send(packb(self.metadata))
        previous: float | None = None
        while True:
            try:
                message = await websocket.recv()
            except websockets.ConnectionClosed:
                logger.info("connection from %s closed", websocket.remote_address)
                return
            started = time.monotonic()
            try:
                if isinstance(message, str):
                    raise LoongError("observations are binary msgpack messages (openpi-client's format), got text")
                observation = unpackb(message)
                if not isinstance(observation, Mapping):
                    raise LoongError(f"an observation is a msgpack map, got a {type(observation).__name__}")
                answer = self.infer(observation)
                answer["server_timing"] = {"infer_ms": (time.monotonic() - started) * 1000}
                if previous is not None:
                    answer["server_timing"]["prev_total_ms"] = previous * 1000
                await websocket.send(packb(answer))
                previous = time.monotonic() - started
            except websockets.ConnectionClosed:
                return
            except Exception as exc:  # the client raises what it is sent (openpi's server does the same)
                text = f"error: {exc}" if isinstance(exc, LoongError) else traceback.format_exc()
                logger.warning("observation from %s failed: %s", websocket.remote_address, text.strip())
                await websocket.send(text)
                await websocket.close(code=1011, reason="Internal server error. The error is in the previous frame.")
                return

    @staticmethod
    def _health(connection: Any, request: Any) -> Any:
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        return None

    async def serve(self, on_ready: Callable[[PolicyServer], None] | None = None) -> None:
        """Serve until :meth:`stop`."""
        from websockets.asyncio.server import serve

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            server = await serve(self._handle, self.host, self.port, compression=None, max_size=None,
                                 process_request=self._health)
        except OSError as exc:
            raise LoongError(f"--port {self.port}: cannot listen on {self.host}:{self.port} ({exc.strerror or exc})"
                             ) from None
        try:
            self.port = next(iter(server.sockets)).getsockname()[1]
            self.ready.set()
            if on_ready is not None:
                on_ready(self)
            await self._stop.wait()
        finally:
            server.close()
            await server.wait_closed()

    def serve_forever(self, on_ready: Callable[[PolicyServer], None] | None = None) -> None:
        """Block serving (Ctrl-C stops it)."""
        asyncio.run(self.serve(on_ready))

    def start(self, timeout: float = 30.0) -> threading.Thread:
        """Serve in a background thread; returns once listening (tests, notebooks)."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.serve_forever()
            except BaseException as exc:  # surfaced by start()
                errors.append(exc)
                self.ready.set()

        thread = threading.Thread(target=run, name="loong-policy-server", daemon=True)
        thread.start()
        self.ready.wait(timeout)
        if errors:
            raise errors[0]
        return thread

    def stop(self) -> None:
        """Stop serving (from any thread)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)


def serve(ckpt: str | Path, *, host: str = "0.0.0.0", port: int = 8000, key_map: Mapping[str, str] | None = None,
          use_default_map: bool = True, ema: bool = False, device: str = "auto", dtype: str = "auto",
          seed: int | None = 0, default_task: str | None = None, source: int | str | None = None,
          on_ready: Callable[[PolicyServer], None] | None = None) -> None:
    """Load the policy of ``ckpt`` and serve it until interrupted; ``source``: a mix-trained policy's dataset
    whose statistics and embodiment the robot uses (:func:`~loong.embodied.inference.resolve_source`)."""
    from loong.embodied.inference import load_policy, resolve_source

    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise LoongError(f"--port: must be 0..65535, got {port!r}")
    keys = KeyMap(key_map, use_defaults=use_default_map)
    loaded = load_policy(ckpt, ema=ema, device=device, dtype=dtype)
    runner = PolicyRunner(loaded, seed=seed, default_task=default_task,
                          source=resolve_source(loaded.processor, source, "--source"))
    PolicyServer(runner, host=host, port=port, key_map=keys).serve_forever(on_ready)


__all__ = ["DEFAULT_KEY_MAP", "KeyMap", "PolicyServer", "flatten", "packb", "read_key_map", "serve", "unpackb"]
