"""Both trajectory sinks prove the sink contract: the local store and the replay service.

``StoreSink`` writes into an ``EpisodeStore`` in a temporary folder; its consumer is
blocked by a real full disk (a tiny tmpfs, which needs root to mount). ``ReplaySink``
talks to a real ``python -m trainer.replay`` process, blocked by stopping the process
(SIGSTOP) so that more chunks wait than the sink's backlog allows.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.store import EpisodeStore, StoreSink
from tests.conformance.trajectory_sink import SinkUnderTest, TrajectorySinkConformance
from tests.test_replay_service import Service, running_service
from trainer.replay.log import LOG_DIR, read_log
from trainer.replay.sink import ReplaySink


@contextlib.contextmanager
def tiny_disk(path: Path) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def disk_full(directory: Path) -> Iterator[None]:
    """Fill the filesystem holding ``directory`` until writes fail with ENOSPC; free it on exit."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    try:
        yield
    finally:
        filler.unlink()


class TestStoreSinkConformance(TrajectorySinkConformance):
    @pytest.fixture
    def sink_under_test(self, tmp_path: Path) -> Iterator[SinkUnderTest]:
        with tiny_disk(tmp_path / "disk") as disk:
            directory = disk / "episodes"
            sink = StoreSink(EpisodeStore(directory, fsync="never"))

            def read_back() -> list:
                return list(EpisodeStore(directory, readonly=True).chunks())

            try:
                yield SinkUnderTest(sink, read_back, blocking=lambda: disk_full(disk))
            finally:
                sink.close()


@pytest.fixture(scope="module")
def replay_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("replay-sink")) as svc:
        yield svc


@contextlib.contextmanager
def stopped(svc: Service) -> Iterator[None]:
    assert svc.proc is not None
    os.kill(svc.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(svc.proc.pid, signal.SIGCONT)


class TestReplaySinkConformance(TrajectorySinkConformance):
    @pytest.fixture
    def sink_under_test(self, replay_service: Service) -> Iterator[SinkUnderTest]:
        sink = ReplaySink(
            replay_service.endpoints["ingest"], max_backlog_chunks=2, resend_timeout_s=0.5, retry_s=0.2
        )

        def read_back() -> list:
            return list(read_log(replay_service.run_dir / LOG_DIR))

        try:
            yield SinkUnderTest(sink, read_back, blocking=lambda: stopped(replay_service))
        finally:
            sink.close()
