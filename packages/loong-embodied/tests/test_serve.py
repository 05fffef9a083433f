"""The policy server against openpi's own client (PyPI ``openpi-client``): metadata on connect, several
observations answered with the actions ``PolicyRunner.infer`` gives locally, openpi's observation layouts through
the key map, errors as text frames, ``/healthz``, the msgpack-numpy encoding both ways, and the CLI command in
a process of its own (listening, answering, Ctrl-C)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from openpi_client import msgpack_numpy
from openpi_client.action_chunk_broker import ActionChunkBroker
from openpi_client.websocket_client_policy import WebsocketClientPolicy

sys.path.insert(0, str(Path(__file__).parent))
import inference_testing as toy  # noqa: E402

from loong.core.errors import LoongError  # noqa: E402
from loong.embodied.envs import ReachEnv  # noqa: E402
from loong.embodied.inference import PolicyRunner, env_observation, load_policy  # noqa: E402
from loong.embodied.serve import KeyMap, PolicyServer, packb, read_key_map, unpackb  # noqa: E402

#: openpi's LIBERO client layout
LIBERO = {"observation/image": "observation.images.top", "observation/wrist_image": "observation.images.wrist"}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    run = tmp_path_factory.mktemp("toy") / "run"
    toy.write_run(run)
    return load_policy(run)


@pytest.fixture(scope="module")
def server(loaded) -> Iterator[PolicyServer]:
    srv = PolicyServer(PolicyRunner(loaded, seed=11), host="127.0.0.1", port=0, key_map=KeyMap(LIBERO))
    srv.start()
    yield srv
    srv.stop()


def _scenes(n: int) -> list[tuple[dict, str]]:
    env = ReachEnv()
    return [(obs, info["task"]) for obs, info in (env.reset(seed=s) for s in range(n))]


def _libero(obs: dict, task: str) -> dict:
    return {"observation/image": obs["pixels"]["top"], "observation/wrist_image": obs["pixels"]["wrist"],
            "observation/state": obs["agent_pos"], "prompt": task, "extra/ignored": np.zeros(3)}


def test_openpi_client_gets_metadata_and_the_local_actions(server: PolicyServer, loaded) -> None:
    client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    meta = client.get_server_metadata()
    assert meta["policy"] == toy.NAME and meta["step"] == 5 and meta["chunk_size"] == 4
    assert meta["cameras"] == toy.ToyProcessor.camera_keys and meta["key_map"]["prompt"] == "task"
    local = PolicyRunner(loaded, seed=11)  # a connection starts from the runner's seed, as this one does
    for obs, task in _scenes(3):
        answer = client.infer(_libero(obs, task))
        expected = local.infer(env_observation(obs, task))["actions"]
        assert answer["actions"].shape == (4, 2) and answer["actions"].dtype == np.float32
        np.testing.assert_array_equal(answer["actions"], expected)
        assert answer["server_timing"]["infer_ms"] > 0
    assert "prev_total_ms" in answer["server_timing"]
    # a second connection starts over: the same first answer
    again = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    obs, task = _scenes(1)[0]
    np.testing.assert_array_equal(again.infer(_libero(obs, task))["actions"],
                                  PolicyRunner(loaded, seed=11).infer(env_observation(obs, task))["actions"])


def test_openpi_layouts_through_the_key_map(loaded) -> None:
    # ALOHA's nested, channel-first images under the default images/* rule; DROID-like split state
    srv = PolicyServer(PolicyRunner(loaded, seed=0), host="127.0.0.1", port=0,
                       key_map=KeyMap({"observation/xy/x": "observation.state", "observation/xy/y": "observation.state"}))
    srv.start()
    try:
        client = WebsocketClientPolicy(host="127.0.0.1", port=srv.port)
        obs, task = _scenes(1)[0]
        aloha = {"images": {cam: np.ascontiguousarray(img.transpose(2, 0, 1)) for cam, img in obs["pixels"].items()},
                 "observation": {"xy": {"y": obs["agent_pos"][1:], "x": obs["agent_pos"][:1]}}, "prompt": task}
        expected = PolicyRunner(loaded, seed=0).infer(env_observation(obs, task))["actions"]
        np.testing.assert_array_equal(client.infer(aloha)["actions"], expected)
        # openpi's broker executes the chunk one action at a time
        broker = ActionChunkBroker(WebsocketClientPolicy(host="127.0.0.1", port=srv.port), action_horizon=2)
        steps = [broker.infer(aloha)["actions"] for _ in range(2)]
        np.testing.assert_array_equal(np.stack(steps), expected[:2])
    finally:
        srv.stop()


def test_errors_reach_the_client_and_the_server_goes_on(server: PolicyServer) -> None:
    client = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    obs, task = _scenes(1)[0]
    broken = {k: v for k, v in _libero(obs, task).items() if k != "observation/image"}
    with pytest.raises(RuntimeError, match="Error in inference server:\nerror: observation: no "
                                           "observation.images.top"):
        client.infer(broken)
    fresh = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
    assert fresh.infer(_libero(obs, task))["actions"].shape == (4, 2)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as response:
        assert response.status == 200 and response.read() == b"OK\n"
    taken = PolicyServer(server.runner, host="127.0.0.1", port=server.port)
    with pytest.raises(LoongError, match=f"--port {server.port}: cannot listen on 127.0.0.1:{server.port}"):
        taken.start()


def test_msgpack_numpy_matches_openpi_client() -> None:
    message = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([[1, 2]], np.uint8),
               "c": np.float32(2.5), "d": {"e": np.array([True, False]), "f": "text", "g": [1, 2.0]},
               "h": np.arange(6, dtype=">i4").reshape(2, 3)[:, ::2]}
    for encode, decode in ((packb, msgpack_numpy.unpackb), (msgpack_numpy.packb, unpackb)):
        if encode is msgpack_numpy.packb:  # openpi's packer needs contiguous arrays
            message["h"] = np.ascontiguousarray(message["h"])
        out = decode(encode(message))
        for key in ("a", "b", "h"):
            assert out[key].dtype == message[key].dtype
            np.testing.assert_array_equal(out[key], message[key])
        assert out["c"] == 2.5 and isinstance(out["c"], np.float32)
        np.testing.assert_array_equal(out["d"]["e"], [True, False])
        assert out["d"]["f"] == "text" and out["d"]["g"] == [1, 2.0]
    with pytest.raises(TypeError, match="dtype object"):
        packb({"x": np.array([None], dtype=object)})
    forged = msgpack_numpy.packb({"x": np.zeros(1)}).replace(b"<f8", b"|O8")  # never unpickled
    with pytest.raises(ValueError, match="dtype object"):
        unpackb(forged)


def test_key_map_rules_and_bad_maps(tmp_path: Path) -> None:
    keys = KeyMap({"cam/*": "observation.images.*", "prompt": "task"})
    assert keys.target("cam/left") == "observation.images.left" and keys.target("images/top") == \
        "observation.images.top"
    assert keys.target("observation.images.x") == "observation.images.x" and keys.target("joint") is None
    assert KeyMap(use_defaults=False).target("prompt") is None
    with pytest.raises(LoongError, match="family"):
        KeyMap({"cam/*": "observation.images.top"})
    with pytest.raises(LoongError, match="the policy's keys are"):
        KeyMap({"image": "pixels"})
    with pytest.raises(LoongError, match="both map to 'observation.images.top'"):
        KeyMap({"a": "observation.images.top", "b": "observation.images.top"}).apply({"a": 1, "b": 2})
    path = tmp_path / "map.json"
    path.write_text('{"observation/image": "observation.images.top", "prompt": "task"}')
    assert read_key_map(path, ["prompt=task", "x=observation.state"]) == {
        "observation/image": "observation.images.top", "prompt": "task", "x": "observation.state"}
    path.write_text("[1]")
    with pytest.raises(LoongError, match="must be a JSON object"):
        read_key_map(path)


SERVE_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import inference_testing
    inference_testing.register()  # the toy is no installed policy: register it in this process
    from loong.embodied.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_serve_command(loaded, tmp_path: Path) -> None:
    script = tmp_path / "serve_toy.py"
    script.write_text(SERVE_SCRIPT.format(tests=str(Path(__file__).parent)))
    run = loaded.run_dir
    keymap = tmp_path / "libero.json"
    keymap.write_text('{"observation/image": "observation.images.top"}')
    proc = subprocess.Popen([sys.executable, str(script), "serve", str(run), "--port", "0", "--host", "127.0.0.1",
                             "--key-map", str(keymap), "--map", "observation/wrist_image=observation.images.wrist",
                             "--seed", "3"], stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        line, deadline = "", time.monotonic() + 120
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
        found = re.search(r"ws://127\.0\.0\.1:(\d+)", line)
        assert found, line
        client = WebsocketClientPolicy(host="127.0.0.1", port=int(found.group(1)))
        assert client.get_server_metadata()["key_map"]["observation/wrist_image"] == "observation.images.wrist"
        obs, task = _scenes(1)[0]
        np.testing.assert_array_equal(client.infer(_libero(obs, task))["actions"],
                                      PolicyRunner(loaded, seed=3).infer(env_observation(obs, task))["actions"])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_embodiment_id_of_a_request_reaches_the_policy() -> None:
    """GR00T's per-embodiment heads per request: ``embodiment_id`` passes the key map (a plain int or msgpack-numpy's
    scalar), where other unknown client keys are dropped."""
    obs = {"prompt": "reach", "state": np.zeros(2, dtype=np.float32), "embodiment_id": np.asarray(3),
           "unrelated": 1}
    out = KeyMap().apply(obs)
    assert out["embodiment_id"] == 3 and isinstance(out["embodiment_id"], int) and "unrelated" not in out
    assert KeyMap().apply({"embodiment_id": 7})["embodiment_id"] == 7
