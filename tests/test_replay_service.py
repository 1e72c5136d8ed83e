"""The replay service as a real process: ingest, acknowledgements, sampling, faults.

Every test talks to ``python -m trainer.replay`` over real ZeroMQ sockets; fault tests
kill it with SIGKILL or fill its disk, then count what the durable log holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
import zmq

from gateway.control_client import ControlClient
from gateway.protocol import Message, MsgType, recv, send
from gateway.trajectory import count_chunks
from tests.conftest import Procs, log_of, loopgate, wait_for
from tests.test_replay_tables import episode_chunks
from trainer.replay.client import ReplayClient, ReplayUnavailable, SampleTimeout
from trainer.replay.log import LOG_DIR, ReplayLog, read_log
from trainer.replay.sink import ReplaySink

pytestmark = pytest.mark.integration

TABLES = [{"name": "online", "max_size": 10_000}, {"name": "demos", "source": "demos", "max_size": 1000}]


def write_run_config(run_dir: Path, **replay: Any) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    block = {"enabled": True, "tables": TABLES, "resend_timeout_s": 0.5, "storage_retry_s": 0.2, **replay}
    cfg = {
        "env": {"backend": "mujoco_reach", "num_envs": 4},
        "policy": {"kind": "random"},
        "gateway": {"worker_timeout_s": 3.0},
        "replay": block,
    }
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Service:
    """One replay service process on a run folder, restartable on the same addresses."""

    def __init__(self, procs: Procs, run_dir: Path, **replay: Any) -> None:
        self.procs, self.run_dir = procs, run_dir
        self.config = write_run_config(run_dir, **replay)
        self.proc: subprocess.Popen[bytes] | None = None
        self.control: ControlClient | None = None

    def start(self) -> Service:
        self.proc = self.procs.spawn(
            "-m",
            "trainer.replay",
            "--config",
            str(self.config),
            "--run-dir",
            str(self.run_dir),
            name="replay",
        )
        path = self.run_dir / "endpoints.json"
        wait_for(lambda: path.exists() and "replay" in json.loads(path.read_text()), what="replay endpoints")
        if self.control is None:
            self.control = ControlClient(self.endpoints["control"])
        wait_for(self._answers, what="replay control socket")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"replay service exited: {log_of(self.proc)}")
        try:
            self.status()
            return True
        except Exception:
            return False

    @property
    def endpoints(self) -> dict[str, str]:
        return json.loads((self.run_dir / "endpoints.json").read_text())["replay"]

    def status(self) -> dict[str, Any]:
        assert self.control is not None
        return self.control.request("status", timeout_s=2.0)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=20) == 0, log_of(self.proc)
        if self.control is not None:
            self.control.close()
            self.control = None


@contextlib.contextmanager
def running_service(tmp: Path) -> Iterator[Service]:
    """A replay service with the default tables in ``tmp/run``, for a module's tests."""
    procs = Procs(tmp)
    try:
        svc = Service(procs, tmp / "run").start()
        yield svc
        if svc.control is not None:
            svc.control.close()
    finally:
        procs.kill_all()


@pytest.fixture
def service(procs: Procs, tmp_path: Path):
    made: list[Service] = []

    def make(**replay: Any) -> Service:
        svc = Service(procs, tmp_path / f"run-{len(made)}", **replay)
        made.append(svc)
        return svc.start()

    yield make
    for svc in made:
        if svc.control is not None:
            svc.control.close()


def pump(sink: ReplaySink, want: set[str], timeout: float = 20.0) -> set[str]:
    got: set[str] = set()

    def done() -> bool:
        sink.tick()
        got.update(sink.poll_acks())
        return want <= got

    wait_for(done, timeout=timeout, interval=0.01, what=f"{len(want)} acknowledgements")
    return got


def stored(run_dir: Path) -> list[Message]:
    return list(read_log(run_dir / LOG_DIR))


def test_acknowledged_chunks_are_in_the_log_and_sampled_with_prefetch(service):
    svc = service()
    sink = ReplaySink(svc.endpoints["ingest"])
    chunks = [c for e in range(6) for c in episode_chunks(f"ep{e}", 10)]
    try:
        for chunk in chunks:
            sink.submit(chunk)
        pump(sink, {c.meta["chunk_id"] for c in chunks})
        assert sink.backlog() == 0 and not sink.blocked
        count = count_chunks(stored(svc.run_dir))
        assert count.stored_steps == 60 and count.duplicate_steps == 0
        with ReplayClient(svc.endpoints["sample"], prefetch=3) as client:
            for _ in range(5):
                batch = client.sample(32, tables="online", timeout_s=5.0)
                np.testing.assert_array_equal(batch["next_obs/q"][:, 0], batch["obs/q"][:, 0] + 1)
                assert batch["policy_version"].tolist() == [1] * 32
            applied = client.update_priorities(batch["key"], np.ones(32), wait_s=5.0)
            assert applied == 32
            tensors = client.sample(16, tables="online", torch=True)
            assert tuple(tensors["obs/q"].shape) == (16, 3)
            status = client.status()
        assert status["tables"]["online"]["size"] == 60
        assert status["tables"]["online"]["rate_limiter"]["can_sample"] is True
    finally:
        sink.close()


def test_a_chunk_sent_twice_is_stored_once(service):
    svc = service()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(svc.endpoints["ingest"])
    try:
        chunk = episode_chunks("dup", 4)[0]
        for _ in range(3):
            send(sock, chunk)
            assert sock.poll(5000)
            ack = recv(sock)
            assert ack.type is MsgType.CHUNK_ACK and ack.meta["ids"] == [chunk.meta["chunk_id"]]
        count = count_chunks(stored(svc.run_dir))
        assert count.chunks == 1 and count.stored_steps == 4
        assert svc.status()["ingest"]["duplicates"] == 2
    finally:
        sock.close(linger=0)


def test_malformed_chunks_are_refused_naming_the_problem_and_the_service_goes_on(service):
    svc = service()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(svc.endpoints["ingest"])
    try:
        good = episode_chunks("ok", 4)[0]
        bad = Message(MsgType.TRAJECTORY_CHUNK, seq=7, meta=dict(good.meta), arrays=dict(good.arrays))
        del bad.arrays["reward"]
        send(sock, bad)
        assert sock.poll(5000)
        err = recv(sock)
        assert (
            err.type is MsgType.ERROR
            and err.meta["code"] == "bad_request"
            and "reward" in err.meta["message"]
        )
        assert err.seq == 7
        wrong = Message(
            MsgType.TRAJECTORY_CHUNK, meta={**good.meta, "chunk_id": "nope:1"}, arrays=good.arrays
        )
        send(sock, wrong)
        assert sock.poll(5000)
        assert "chunk_id" in recv(sock).meta["message"]
        send(sock, good)
        assert sock.poll(5000)
        assert recv(sock).type is MsgType.CHUNK_ACK
        last = episode_chunks("fo", 4)[-1]
        last.arrays["final_obs/q"] = np.zeros((1, 7), np.float32)
        send(sock, last)
        assert sock.poll(5000)
        assert "final_obs/q" in recv(sock).meta["message"]
        send(sock, episode_chunks("wide", 4, obs_size=5)[0])
        assert sock.poll(5000)
        assert "differ from the steps already stored" in recv(sock).meta["message"]
        assert count_chunks(stored(svc.run_dir)).chunks == 1
        assert svc.status()["ingest"]["malformed"] == 4
    finally:
        sock.close(linger=0)


def test_sampling_an_empty_or_rate_limited_table_times_out_with_a_typed_error(service):
    svc = service(
        tables=[{"name": "online", "min_size_to_sample": 50, "samples_per_insert": 1, "error_buffer": 10}]
    )
    with ReplayClient(svc.endpoints["sample"], prefetch=2) as client:
        with pytest.raises(SampleTimeout, match="min_size_to_sample"):
            client.sample(8, tables="online", timeout_s=0.3)
        with pytest.raises(Exception, match="no table 'nope'"):
            client.sample(8, tables="nope", timeout_s=0.3)
        sink = ReplaySink(svc.endpoints["ingest"])
        try:
            chunks = [c for e in range(6) for c in episode_chunks(f"e{e}", 10)]
            for chunk in chunks:
                sink.submit(chunk)
            pump(sink, {c.meta["chunk_id"] for c in chunks})
        finally:
            sink.close()
        # 60 inserted with ratio 1 and buffer 10: at most 60 - (50 - 10) = 20 samples
        wait_for(lambda: svc.status()["tables"]["online"]["size"] == 60, what="items in the table")
        client.sample(16, tables="online", timeout_s=2.0)
        with pytest.raises(SampleTimeout, match="samples_per_insert"):
            client.sample(16, tables="online", timeout_s=0.3)
    metrics = [json.loads(x) for x in (svc.run_dir / "metrics.jsonl").read_text().splitlines()]
    limiter = [m["tables"]["online"]["rate_limiter"] for m in metrics if m["service"] == "replay"]
    assert limiter and "can_sample" in limiter[-1]


def test_a_wait_for_a_silent_service_ends_when_the_client_is_interrupted():
    """A replay service that is gone or frozen (a ROUTER that takes requests and never
    answers) and a trainer told to stop: the wait ends at the next check of
    ``interrupted``, not after the request's 60 s timeout, and says why."""
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    checks: list[int] = []

    def interrupted() -> bool:
        checks.append(len(checks))
        return len(checks) >= 3  # the third check: a signal came meanwhile

    try:
        with ReplayClient(f"tcp://127.0.0.1:{port}", prefetch=2, interrupted=interrupted) as client:
            with pytest.raises(ReplayUnavailable, match="interrupted waiting for the replay service"):
                client.sample(8, timeout_s=60.0)
            assert len(checks) == 3
            assert silent.poll(5000), "the request never reached the service"
    finally:
        silent.close()


def test_sigkill_during_ingest_loses_no_acknowledged_step(service):
    """Kill -9 the service while chunks stream in; after a restart every acknowledged
    step is in the log exactly once, and the resent rest completes the set."""
    svc = service(fsync="always")
    sink = ReplaySink(svc.endpoints["ingest"], resend_timeout_s=0.5)
    chunks = [c for e in range(40) for c in episode_chunks(f"k{e}", 30, per_chunk=8)]
    acked: set[str] = set()
    try:
        for chunk in chunks:
            sink.submit(chunk)
            acked.update(sink.poll_acks())
            if len(acked) >= 40:
                break
        svc.kill()
        acked.update(sink.poll_acks())  # acks already received before the kill
        before = count_chunks(m for m in stored(svc.run_dir))
        have = {m.meta["chunk_id"] for m in stored(svc.run_dir)}
        assert acked <= have, f"acknowledged but missing: {sorted(acked - have)[:5]}"
        assert before.duplicate_steps == 0
        svc.start()
        for chunk in chunks:
            sink.submit(chunk)
        pump(sink, {c.meta["chunk_id"] for c in chunks} - acked, timeout=60)
        count = count_chunks(stored(svc.run_dir))
        assert count.stored_steps == 40 * 30 and count.duplicate_steps == 0 and count.duplicate_chunks == 0
        # A chunk is acknowledged once durable; the service loop inserts it into the
        # tables right after, so the last ones may still be on their way.
        wait_for(
            lambda: svc.status()["tables"]["online"]["size"] >= 40 * 30, what="every stored step in the table"
        )
        assert svc.status()["tables"]["online"]["size"] == 40 * 30
    finally:
        sink.close()


def test_an_episode_whose_second_chunk_arrives_first_has_every_step_in_its_table(service):
    """What a resend after a restart can bring: chunk 1 of an episode stored before its
    chunk 0. Both are acknowledged; every step is sampleable, before and after a restart
    that rebuilds the tables from the log in that order."""
    svc = service()
    sink = ReplaySink(svc.endpoints["ingest"], resend_timeout_s=0.5)
    try:
        first, second, *rest = episode_chunks("swap", 24, per_chunk=8)
        for chunk in (second, first, *rest):
            sink.submit(chunk)
            pump(sink, {chunk.meta["chunk_id"]})
        wait_for(lambda: svc.status()["tables"]["online"]["size"] >= 24, what="all 24 steps in the table")
        status = svc.status()
        assert status["tables"]["online"]["size"] == 24 and status["late_chunks"] == 0, status
        svc.kill()
        svc.start()
        status = svc.status()
        assert status["tables"]["online"]["size"] == 24 and status["late_chunks"] == 0, status
    finally:
        sink.close()


def test_a_corrupted_segment_is_reported_and_skipped_without_losing_the_others(service, tmp_path):
    run_dir = tmp_path / "run-0"
    replay_log = ReplayLog(run_dir / LOG_DIR, segment_bytes=4000, fsync="never")
    chunks = [c for e in range(8) for c in episode_chunks(f"c{e}", 8)]
    replay_log.append_group(chunks)
    replay_log.close()
    segments = sorted((run_dir / LOG_DIR).glob("seg-*.log"))
    assert len(segments) >= 3
    data = bytearray(segments[1].read_bytes())
    data[40] ^= 0xFF
    data[41] ^= 0xFF
    segments[1].write_bytes(bytes(data))
    svc = service()
    status = svc.status()
    assert status["recovery"]["corrupt_records"] == 1
    assert status["recovery"]["corrupt_segments"] == [int(segments[1].name[4:16])]
    survivors = stored(run_dir)
    assert len(survivors) == len(chunks) - 1
    assert status["log"]["chunks"] == len(chunks) - 1
    assert "corrupted record" in log_of(svc.proc)  # type: ignore[arg-type]


def test_export_and_summary_of_a_loopgate_up_run_with_replay(tmp_path):
    """``loopgate up`` with the replay service: summary counts from its log, exports read back."""
    run_dir = tmp_path / "run"
    done = loopgate(
        "up", "configs/collect_pd.yaml", "--run-dir", str(run_dir), "--max-env-steps", "600",
        "--set", "replay.enabled=true", "--set", "env.workers=1", "--set", "env.num_envs=4",
        env={"MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["acked_steps"] >= 600
    assert summary["stored_steps"] == summary["acked_steps"] and summary["duplicate_steps"] == 0
    assert (run_dir / LOG_DIR).is_dir() and not (run_dir / "episodes").exists()


def test_disk_full_blocks_the_gateway_and_loses_nothing(procs, tmp_path):
    """A full disk, simulated honestly: the replay log lives on a tiny tmpfs (mounted here,
    which needs root) that a filler file nearly fills. Ingest fails with ENOSPC, the
    service answers ``storage``, the gateway's sink blocks and the gateway stops giving
    actions; deleting the filler frees the disk, collection resumes, and every
    acknowledged step ends up in the log exactly once."""
    run_dir = tmp_path / "run"
    mount = run_dir / "replay"
    mount.mkdir(parents=True)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip(
            "cannot mount a tmpfs here (needs root); the disk-full test needs a real small filesystem"
        )
    try:
        filler = mount / "filler"
        filler.write_bytes(b"\0" * (1024 * 1024 - 96 * 1024))
        svc = Service(procs, run_dir, fsync="always", max_backlog_chunks=64).start()
        gw = procs.spawn(
            "-m", "gateway.hub", "--config", str(svc.config), "--run-dir", str(run_dir), name="gateway"
        )
        path = run_dir / "endpoints.json"
        wait_for(lambda: "gateway" in json.loads(path.read_text()), what="gateway endpoints")
        control = ControlClient(json.loads(path.read_text())["gateway"]["control"])
        try:
            wait_for(lambda: _status(control) is not None, what="gateway control")
            procs.spawn(
                "-m", "gateway.worker", "--config", str(svc.config), "--endpoints", str(path), name="worker"
            )
            wait_for(lambda: (_status(control) or {}).get("sink_blocked"), timeout=60, what="sink blocked")
            assert "ENOSPC" in (svc.status()["storage_error"] or "")
            frozen = _status(control)["env_steps"]
            time.sleep(0.5)
            assert _status(control)["env_steps"] <= frozen + 4  # at most the observation in flight
            filler.unlink()
            wait_for(
                lambda: _status(control)["env_steps"] > frozen + 200, timeout=60, what="collection resumed"
            )
            control.request("pause", timeout_s=5.0)
            final = control.request("drain", timeout_s=30.0)
        finally:
            control.close()
        os.killpg(gw.pid, signal.SIGTERM)
        gw.wait(timeout=20)
        svc.stop()
        count = count_chunks(m for m in stored(run_dir) if m.meta.get("source", "online") == "online")
        assert count.stored_steps == final["acked_steps"] and count.duplicate_steps == 0
    finally:
        procs.kill_all()
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _status(control: ControlClient) -> dict[str, Any] | None:
    from gateway.protocol import Timeout

    try:
        return control.request("status", timeout_s=2.0)
    except Timeout:
        return None


def make_earlier_run(run_dir: Path, episodes: int = 3) -> int:
    """A finished run with a local episode store (and one evaluation episode)."""
    from gateway.store import EpisodeStore

    store = EpisodeStore(run_dir / "episodes", fsync="never")
    steps = 0
    for e in range(episodes):
        for chunk in episode_chunks(f"old{e}", 10):
            store.put(chunk)
            steps += int(chunk.meta["num_steps"])
    for chunk in episode_chunks("old-eval", 10, eval=True):
        store.put(chunk)
    store.close()
    return steps


def test_demonstrations_are_imported_once_offline_online_and_from_config(service, tmp_path):
    earlier = tmp_path / "teleop"
    steps = make_earlier_run(earlier)
    svc = service(demos_from=[str(earlier)])
    demos = svc.status()["tables"]["demos"]
    assert demos["size"] == steps and svc.status()["tables"]["online"]["size"] == 0  # eval left out
    # Through the running service: already there, stored once.
    out = loopgate("replay", "import", str(earlier), "--table", "demos", "--run-dir", str(svc.run_dir))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["chunks"] == 0 and json.loads(out.stdout)["already_imported"] > 0
    # Offline into a stopped service's log; the next start rebuilds the table from it.
    svc.stop()
    second = tmp_path / "teleop2"
    make_earlier_run(second, episodes=2)
    out = loopgate("replay", "import", str(second), "--table", "demos", "--run-dir", str(svc.run_dir))
    assert out.returncode == 0, out.stderr
    svc.start()
    assert svc.status()["tables"]["demos"]["size"] == steps + 20
    with ReplayClient(svc.endpoints["sample"]) as client:
        batch = client.sample(64, tables={"demos": 1.0}, timeout_s=5.0)
    np.testing.assert_array_equal(batch["next_obs/q"][:, 0], batch["obs/q"][:, 0] + 1)
    # Demonstrations are not steps of this run: summary counts leave them out.
    from trainer.replay.log import count_store

    assert count_store(None, svc.run_dir).stored_steps == 0
    bad = loopgate("replay", "import", str(second), "--table", "online", "--run-dir", str(svc.run_dir))
    assert bad.returncode == 2 and "source: demos" in bad.stderr
    unknown = loopgate("replay", "import", str(second), "--table", "demo", "--run-dir", str(svc.run_dir))
    assert unknown.returncode == 2
    assert "ERROR no replay table 'demo'; tables: online, demos\n" in unknown.stderr, unknown.stderr


def test_replay_and_export_help_show_a_runnable_example():
    for args in (("replay", "--help"), ("replay", "import", "--help"), ("export", "--help")):
        out = loopgate(*args)
        assert out.returncode == 0 and "example: loopgate " in out.stdout
