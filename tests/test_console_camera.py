"""The observation tap and the console's camera feed, on real ZeroMQ sockets.

The tap is a real XPUB on loopback; the feed's WebSocket is served by the real app
(Starlette's test client) from a real tap fed with MuJoCo camera images.
"""

from __future__ import annotations

import io
import json
import struct
import time

import numpy as np
import pytest
import zmq

from gateway import steps
from gateway.console.camera import FrameSource, camera_key, encode_jpeg, frame_header, pack_frame, parse_watch
from gateway.protocol import Message, MsgType
from gateway.tap import ObservationTap, TapReader
from tests.conftest import wait_for

pytestmark = pytest.mark.unit


def obs_message(seq: int, num_envs: int = 2, image: np.ndarray | None = None) -> Message:
    info = steps.pack(
        episode=np.arange(num_envs),
        step=seq,
        t_capture=time.time(),
        has_prev=1,
        reward=-0.5,
        terminated=0,
        truncated=0,
        success=np.arange(num_envs) == 1,
    )
    arrays = {
        "obs/joint_pos": np.full((num_envs, 3), 0.1 * seq, np.float32),
        "step_info": info,
    }
    if image is not None:
        arrays["obs/image"] = np.broadcast_to(image, (num_envs, *image.shape)).copy()
    return Message(MsgType.OBSERVATION, seq=seq, meta={"uid": "w0"}, arrays=arrays)


@pytest.fixture
def ctx():
    context = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


def test_the_tap_sends_nothing_until_someone_listens_and_then_at_most_max_hz(ctx):
    # 2 Hz: a window wide enough that a loaded machine cannot outlast it between two calls.
    tap = ObservationTap(ctx, "tcp://127.0.0.1:0", uid="w0", max_hz=2.0)
    try:
        assert not tap.publish(obs_message(1), None, None)  # nobody listens: not even built
        reader = TapReader(ctx, [tap.address])
        wait_for(lambda: (tap._hear_subscriptions(), tap.listeners)[1] == 1, 5, what="the subscription")
        assert tap.publish(obs_message(2), np.zeros((2, 3), np.float32), np.array([7, 7]))
        assert not tap.publish(obs_message(3), None, None)  # within 1/2 s of the last
        got = reader.poll(2.0)
        assert set(got) == {"w0"} and got["w0"].seq == 2
        assert got["w0"].policy_version.tolist() == [7, 7] and got["w0"].num_envs == 2
        np.testing.assert_allclose(got["w0"].obs["joint_pos"], 0.2)
        time.sleep(0.5)
        assert tap.publish(obs_message(4), None, None)
        assert reader.poll(2.0)["w0"].action is None
        reader.close()
        wait_for(lambda: (tap._hear_subscriptions(), tap.listeners)[1] == 0, 5, what="the unsubscription")
        assert not tap.publish(obs_message(5), None, None)
    finally:
        tap.close()


def test_a_reader_keeps_the_newest_message_per_worker_and_survives_garbage(ctx):
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    reader = TapReader(ctx, [f"tcp://127.0.0.1:{port}"])
    try:
        time.sleep(0.3)  # the subscription reaches the PUB
        from gateway.protocol import send

        pub.send_multipart([b"garbage"])
        for seq in (1, 2, 3):
            send(pub, obs_message(seq))
        other = obs_message(9)
        other.meta["uid"] = "w1"
        send(pub, other)
        latest: dict = {}
        wait_for(lambda: latest.update(reader.poll(0.2)) or len(latest) == 2, 5, what="both workers")
        assert latest["w0"].seq == 3 and latest["w1"].seq == 9
        assert reader.malformed >= 1
    finally:
        reader.close()
        pub.close()


def test_watch_messages_are_validated():
    assert parse_watch({"type": "watch", "worker": "w0", "env": 1}) == ("w0", 1)
    assert "worker uid" in str(parse_watch({"type": "watch", "env": 1}))
    assert "non-negative integer" in str(parse_watch({"worker": "w0", "env": -1}))
    assert "non-negative integer" in str(parse_watch({"worker": "w0", "env": True}))
    assert "JSON objects" in str(parse_watch([1]))


def test_frame_header_and_jpeg_carry_the_env_state_and_picture(ctx):
    from PIL import Image

    picture = np.zeros((224, 224, 3), np.uint8)
    picture[:, :112] = (200, 30, 30)
    msg = obs_message(5, image=picture)
    frame = TapReader._frame(msg)
    assert camera_key(frame.obs) == "image"
    header = frame_header(frame, 1)
    assert header["env"] == 1 and header["success"] and header["reward"] == -0.5
    assert header["joint_pos"] == [0.5, 0.5, 0.5] and header["t_render_ms"] > 1e12
    jpeg = encode_jpeg(frame.obs["image"][1])
    decoded = np.asarray(Image.open(io.BytesIO(jpeg)))
    assert decoded.shape == (224, 224, 3) and abs(int(decoded[10, 10, 0]) - 200) < 10
    packed = pack_frame(header, jpeg)
    (size,) = struct.unpack(">I", packed[:4])
    assert json.loads(packed[4 : 4 + size])["seq"] == 5 and packed[4 + size :] == jpeg


def test_camera_socket_sends_only_newest_frames_and_waits_for_acks(ctx):
    """The real app's /ws/camera under a real uvicorn, fed by a real tap (its session and
    Origin checks are the app's ``admit``, tested against a real run in test_console.py)."""
    import threading

    import uvicorn
    from fastapi import FastAPI
    from websockets.sync.client import connect

    from gateway.console import camera
    from gateway.services import free_port

    tap = ObservationTap(ctx, "tcp://127.0.0.1:0", uid="w0", max_hz=1000.0)
    source = FrameSource([tap.address], ctx)
    source.start()
    app = FastAPI()

    async def admit(ws):
        await ws.accept()
        return "viewer"

    camera.install(app, source, admit)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    picture = np.full((32, 32, 3), 90, np.uint8)

    def frame_of(data: bytes) -> dict:
        (size,) = struct.unpack(">I", data[:4])
        return json.loads(data[4 : 4 + size])

    try:
        wait_for(lambda: server.started, 10, what="uvicorn to start")
        with connect(f"ws://127.0.0.1:{port}/ws/camera", open_timeout=5) as ws:
            ws.send(json.dumps({"type": "watch", "worker": "w0", "env": 7}))
            ws.send(json.dumps({"type": "nonsense"}))
            assert "unknown camera message" in json.loads(ws.recv(timeout=5))["message"]
            wait_for(
                lambda: (tap._hear_subscriptions(), tap.listeners)[1] >= 1, 5, what="the console to listen"
            )
            tap.publish(obs_message(1, image=picture), None, None)
            assert "envs 0..1" in json.loads(ws.recv(timeout=5))["message"]
            ws.send(json.dumps({"type": "watch", "worker": "w0", "env": 1}))
            seen: list[dict] = []
            for seq in range(2, 40):
                tap.publish(obs_message(seq, image=picture), None, None)
                time.sleep(0.005)
                if len(seen) < 2 and seq > 5:
                    seen.append(frame_of(ws.recv(timeout=5)))
            # Two frames in flight and unacknowledged: nothing more comes until an ack...
            assert len(seen) == 2 and seen[0]["seq"] < seen[1]["seq"] and seen[1]["image"]
            with pytest.raises(TimeoutError):
                ws.recv(timeout=0.3)
            wait_for(lambda: source.latest["w0"].seq >= 39, 5, what="the last frames to reach the console")
            ws.send(json.dumps({"type": "ack", "seq": seen[0]["seq"]}))
            # ...and then the newest frame, not the ones published meanwhile.
            assert frame_of(ws.recv(timeout=5))["seq"] == source.latest["w0"].seq == 39
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        source.close()
        tap.close()
