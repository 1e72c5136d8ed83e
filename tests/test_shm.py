"""Shared memory between env workers and the gateway: handles on the socket, arrays in place,
and no segment left in /dev/shm whatever dies when.

Real segments in /dev/shm, real gateway and worker processes on loopback, SIGKILL.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from gateway import shm, steps
from gateway.protocol import Message, MsgType, ProtocolError
from gateway.store import EpisodeStore
from tests.conftest import log_of, time_left, wait_for

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")


ROWS = 4096
"""Rows of a hand-made observation: its two large arrays are over ``shm.MIN_BYTES``."""
ENVS = shm.MIN_BYTES // (8 * steps.WIDTH)
"""Counter envs of a worker whose step_info (``steps.WIDTH`` float64 a row) is just large
enough to go through the ring; its one-float observations stay frames."""


def observation(seq: int, n: int = ROWS) -> Message:
    rng = np.random.default_rng(seq)
    arrays = {
        "obs/policy": rng.standard_normal((n, 15)).astype(np.float32),
        "obs/flag": np.ones((n,), np.uint8),  # small: stays a frame
        "step_info": rng.standard_normal((n, 9)),
    }
    return Message(MsgType.OBSERVATION, seq=seq, meta={"uid": "w"}, arrays=arrays)


@pytest.fixture
def ring():
    writer = shm.ShmWriter.create(shm.slot_bytes_for(ROWS * (60 + 72)), slots=3)
    try:
        yield writer
    finally:
        writer.close()


@pytest.mark.unit
def test_large_arrays_travel_as_handles_and_arrive_equal_in_place(ring):
    view = shm.ShmView.attach(ring.offer())
    ring.accepted()
    assert not ring.linked and shm.segments_of(os.getpid()) == []  # unlinked once both mapped
    for seq in range(1, 8):
        msg = observation(seq)
        sent = ring.encode(msg)
        assert set(sent.arrays) == {"obs/flag"}  # only the small one is a frame
        assert sent.meta["shm"]["slot"] == seq % 3
        got = view.decode(sent)
        assert "shm" not in got.meta and got.meta["uid"] == "w"
        for key, value in msg.arrays.items():
            np.testing.assert_array_equal(got.arrays[key], value)
        assert not got.arrays["obs/policy"].flags.writeable
    assert ring.bytes_shared == view.bytes_shared == 7 * ROWS * (60 + 72)


@pytest.mark.unit
def test_arrays_that_do_not_fit_a_slot_go_as_frames(ring):
    msg = observation(1, n=16 * ROWS)  # 16x what the ring was sized for
    sent = ring.encode(msg)
    assert "obs/policy" in sent.arrays or "step_info" in sent.arrays
    got = shm.ShmView.attach(ring.offer()).decode(sent)
    for key, value in msg.arrays.items():
        np.testing.assert_array_equal(got.arrays[key], value)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda h: h.update(slot=7), r"slot 7 is not in \[0, 3\)"),
        (lambda h: h["arrays"][0].__setitem__(3, 1 << 40), "do not fit"),
        (lambda h: h["arrays"][0].__setitem__(1, "object"), "dtype 'object' is not allowed"),
        (lambda h: h["arrays"][0].__setitem__(2, [-1]), "bad shape"),
        (lambda h: h["arrays"][0].__setitem__(0, "obs/flag"), "both a frame and a handle"),
        (lambda h: h.update(arrays="x"), "must be {slot, arrays}"),
    ],
)
def test_a_bad_handle_is_refused_naming_the_problem(ring, change, match):
    view = shm.ShmView.attach(ring.offer())
    sent = ring.encode(observation(1))
    change(sent.meta["shm"])
    with pytest.raises(ProtocolError, match=match):
        view.decode(sent)
    assert view.decode(ring.encode(observation(2))).arrays["obs/policy"].shape == (ROWS, 15)


@pytest.mark.unit
def test_a_vanished_or_foreign_segment_is_declined_and_its_name_removed(ring):
    offer = ring.offer()
    ring.unlink()  # the segment vanished (its worker died and a sweep removed it)
    with pytest.raises(ValueError, match="does not exist"):
        shm.ShmView.attach(offer)
    other = shm.ShmWriter.create(8192)
    try:
        with pytest.raises(ValueError, match="another host"):
            shm.ShmView.attach({**other.offer(), "host": "elsewhere/boot"})
        with pytest.raises(ValueError, match="not a loopgate segment"):
            shm.ShmView.attach({**other.offer(), "name": "../etc/passwd"})
        with pytest.raises(ValueError, match="slot_bytes"):
            shm.ShmView.attach({**other.offer(), "slot_bytes": 0})
        assert not other.seg.path.exists()  # declined, and its name removed all the same
    finally:
        other.close()


@pytest.mark.unit
def test_a_ring_larger_than_free_shared_memory_is_refused_up_front_and_leaves_no_name():
    with pytest.raises(OSError):  # ENOSPC at creation, not SIGBUS at the first write
        shm.ShmWriter.create(1 << 44)  # 64 TiB: more than any /dev/shm holds
    assert shm.segments_of(os.getpid()) == []


@pytest.mark.unit
def test_the_sweep_removes_segments_of_dead_processes_only(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    mine = shm.ShmWriter.create(4096, directory=tmp_path)
    stale = tmp_path / f"{shm.PREFIX}{dead.pid}-abc"
    stale.write_bytes(b"x")
    try:
        assert shm.sweep_stale(tmp_path) == [stale.name]
        assert not stale.exists() and mine.seg.path.exists()
    finally:
        mine.close()
    assert not mine.seg.path.exists()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("mode", "address", "wanted"),
    [
        ("auto", "tcp://127.0.0.1:5555", True),
        ("auto", "ipc:///tmp/run/workers.sock", True),
        ("auto", "tcp://10.1.2.3:5555", False),
        ("on", "tcp://10.1.2.3:5555", True),
        ("off", "tcp://127.0.0.1:5555", False),
    ],
)
def test_shared_memory_is_offered_for_local_gateways_or_when_asked(mode, address, wanted):
    assert shm.wanted(mode, address) is wanted


def _counter_run(gateway_run, shared_memory: str = "auto", **options: Any):
    return gateway_run(
        {
            "env": {"backend": "counter", "num_envs": ENVS, "options": {"max_episode_steps": 30, **options}},
            "policy": {"kind": "random"},
            "gateway": {"worker_timeout_s": 2.0, "shared_memory": shared_memory},
        }
    )


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_sigkilled_worker_leaves_no_segment_its_episodes_interrupted_and_nothing_acked_lost(gateway_run):
    """Episodes far longer than the run and no early success, so each of the envs holds
    an open episode whenever the kill lands (with 30-step episodes, all in step, a kill
    right after their common end found almost none open)."""
    run = _counter_run(gateway_run, max_episode_steps=100_000, success_radius=0.0)
    worker = run.worker(0)
    status = wait_for(
        lambda: (s := run.status())["env_steps"] >= ENVS * 30 and s,
        timeout=time_left(),
        what="the worker to collect 30 batches",
    )
    (w,) = status["workers"]
    # step_info (128 KiB a batch) goes through the ring, the two small observations as frames.
    assert w["shm"] and w["shm_bytes"] >= 30 * ENVS * 8 * 8 and w["frame_bytes"] < w["shm_bytes"] / 2
    # Unlinked as soon as both mapped it: nothing in /dev/shm even while both run.
    assert shm.segments_of(worker.pid) == [] and shm.segments_of(run.proc.pid) == []
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    status = wait_for(
        lambda: (s := run.status())["workers"] == [] and s, timeout=time_left(), what="the worker to time out"
    )
    assert status["open_episodes"] == 0 and status["episodes_interrupted"] == ENVS
    acked = status["acked_steps"]
    assert run.drain()["drained"]
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == acked and count.duplicate_steps == 0
    assert count.interrupted_episodes == status["episodes_interrupted"]
    run.kill()
    assert shm.segments_of(worker.pid) == [] and shm.segments_of(run.proc.pid) == []


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_gateway_that_declines_gets_frames_and_the_name_is_removed(gateway_run):
    run = _counter_run(gateway_run, shared_memory="off")
    worker = run.worker(0, "--shared-memory", "on")  # offers; the gateway declines
    status = wait_for(
        lambda: (s := run.status())["env_steps"] >= ENVS * 10 and s, timeout=time_left(), what="10 batches"
    )
    (w,) = status["workers"]
    assert not w["shm"] and w["shm_bytes"] == 0 and w["frame_bytes"] > 10 * ENVS * 8 * 8
    assert shm.segments_of(worker.pid) == []
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_restarted_gateway_gets_a_fresh_ring_and_nothing_is_lost_or_left_behind(gateway_run):
    run = _counter_run(gateway_run)
    worker = run.worker(0)
    wait_for(lambda: run.status()["env_steps"] >= ENVS * 20, timeout=time_left(), what="20 batches")
    first_gateway = run.proc.pid
    first_ring = re.search(r"shared memory (loopgate-[0-9a-f-]+)", log_of(worker))
    assert first_ring is not None
    run.kill()  # SIGKILL: its mapping goes with it; the worker's ring was unlinked long ago
    # A worker on the local link sees its gateway go at once and may already offer a fresh
    # ring in its next HELLO (named until a gateway maps it): only the first one is checked.
    assert shm.segments_of(first_gateway) == [] and first_ring[1] not in shm.segments_of(worker.pid)
    run.start()  # same run folder, same addresses: the worker reconnects and resends
    status = wait_for(
        lambda: (
            (s := run.status())["workers"]
            and s["workers"][0]["shm_bytes"] > 0
            and s["env_steps"] > ENVS * 10
            and s
        ),
        timeout=time_left(),
        what="the worker to collect through a new ring",
    )
    assert status["workers"][0]["shm"] and shm.segments_of(worker.pid) == []
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    status = wait_for(lambda: (s := run.status())["workers"] == [] and s, timeout=time_left(), what="BYE")
    acked = status["acked_steps"]
    assert run.drain()["drained"]
    count = EpisodeStore(run.run_dir / "episodes", readonly=True).count()
    assert count.stored_steps == acked and count.duplicate_steps == 0
    assert shm.segments_of(worker.pid) == []
