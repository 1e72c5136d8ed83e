"""Per-step round trip through the gateway against raw ZeroMQ, for three observation sizes.

For each size (64 B, 4 KiB, 150 KiB observations of one env) and each repeat, three
measurements run back to back, in rotating order:

- **gateway**: the real gateway process (``python -m gateway.hub``, started the way
  ``loopgate up`` starts it, policy ``random`` in-process, default recording to a
  spool and a local episode store under a temporary run folder) and the product's
  ``EnvWorker`` hosting one :class:`~benchmarks.payload.PayloadBackend` env in another
  process (:mod:`benchmarks.rtt_peers`). The round trip is the worker's own: from
  sending an OBSERVATION to holding the decoded ACTION, so it includes both codecs,
  the gateway's validation, the spool write of the step and the policy.
- **zmq** (baseline): raw pyzmq DEALER -> ROUTER over the same TCP loopback, one frame
  of the same size out, one action-sized frame back, nothing else.
- **unix** (a reference, against ``zmq``): the same payload and reply over a unix
  socket with :mod:`multiprocessing.connection`, as a ``multiprocessing.Pipe`` (and so
  gymnasium's AsyncVectorEnv) sends them: what a transport without ZeroMQ's I/O threads
  costs on this machine (``collect.steps_per_s.n1`` compares the gateway with exactly
  that).

Every pair runs on the same CPU placement: server (gateway, ROUTER or listener) on the first
allowed CPU, client (worker or DEALER) on the second (both on one when only one is
allowed). Warm-up steps are discarded; each repeat gives a p50 and a p99; records
are the medians over repeats. ``gateway.loop_p50_us`` is the worker's whole per-step
period (env step to env step, i.e. including building the message) against the raw
client's loop period, for where the time outside the round trip goes::

    loopgate bench --only gateway.rtt          # or: --only 4KiB
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.procs import Processes, describe_cpus, split_placement
from benchmarks.records import Record

log = logging.getLogger(__name__)

SIZES: dict[str, int] = {"64B": 64, "4KiB": 4096, "150KiB": 150 * 1024}
"""Observation sizes by the label used in record names."""

TARGET_SIZE = "4KiB"
TARGET = "<= 2.5"
"""The team's goal: gateway p50 round trip at most 2.5x raw ZeroMQ's at 4 KiB."""

SIDES = ("zmq", "gateway", "unix")
"""Measured in this order in the first repeat; each later repeat starts one further on."""
SIDE_NOTES = {"unix": "multiprocessing.connection over a unix socket; "}

NAMES: tuple[str, ...] = tuple(
    f"{side}.{metric}.{label}"
    for label in SIZES
    for side in SIDES
    for metric in ("rtt_p50_us", "rtt_p99_us", "loop_p50_us")
)

WAIT_S = 120.0
"""Longest a client may take for its steps before the measurement is declared hung."""


def _steps(quick: bool, nbytes: int) -> tuple[int, int]:
    """(warm-up, measured) steps: enough for a stable p99, bounded in time for big payloads."""
    if quick:
        return 100, 500 if nbytes < 100_000 else 300
    return 500, 5000 if nbytes < 100_000 else 3000


def _free_port() -> int:
    from gateway.services import free_port

    return free_port()


def _client_args(address: str, nbytes: int, warmup: int, steps: int, out: Path) -> list[str]:
    """Arguments shared by the two clients (the worker and the raw DEALER)."""
    args = ["--connect", address, "--bytes", str(nbytes)]
    return [*args, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def measure_zmq(
    tmp: Path, nbytes: int, warmup: int, steps: int, cpus: tuple[set[int], set[int]]
) -> dict[str, np.ndarray]:
    """Raw DEALER/ROUTER round trips of ``nbytes`` (after ``warmup`` steps)."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    out = tmp / "zmq.npz"
    server = ["zmq-server", "--bind", address, "--bytes", str(nbytes)]
    with Processes(tmp / "logs") as procs:
        procs.python("zmq-server", "benchmarks.rtt_peers", *server, cpus=cpus[0])
        client = ["zmq-client", *_client_args(address, nbytes, warmup, steps, out)]
        procs.python("zmq-client", "benchmarks.rtt_peers", *client, cpus=cpus[1])
        procs.wait("zmq-client", WAIT_S)
        procs.check_alive("zmq-server")
    return _load(out)


def measure_unix(
    tmp: Path, nbytes: int, warmup: int, steps: int, cpus: tuple[set[int], set[int]]
) -> dict[str, np.ndarray]:
    """Round trips of ``nbytes`` over a unix socket (``multiprocessing.connection``)."""
    from benchmarks.inference import wait_until

    path = tmp / "rtt.sock"
    out = tmp / "unix.npz"
    with Processes(tmp / "logs") as procs:
        procs.python("unix-server", "benchmarks.rtt_peers", "unix-server", "--bind", str(path),
                     "--bytes", str(nbytes), cpus=cpus[0])  # fmt: skip
        # A unix socket refuses a client until its server listens (ZeroMQ would retry).
        wait_until(lambda: path.exists() or procs.check_alive("unix-server"), 60, "the unix socket server")
        client = ["unix-client", *_client_args(str(path), nbytes, warmup, steps, out)]
        procs.python("unix-client", "benchmarks.rtt_peers", *client, cpus=cpus[1])
        procs.wait("unix-client", WAIT_S)
        procs.wait("unix-server", 10.0)  # it ends by itself once its client has closed
    return _load(out)


def write_run(run_dir: Path, nbytes: int) -> dict[str, Any]:
    """Config, spec and endpoints of a gateway run for payload ``nbytes`` (as ``loopgate up`` writes them)."""
    from benchmarks.payload import payload_spec

    run_dir.mkdir(parents=True, exist_ok=True)
    # The gateway takes the experiment's spec from --spec (as under `loopgate up`);
    # the env block only has to be a valid config, the gateway never builds it.
    config = {
        "env": {"backend": "mujoco_reach"},
        "policy": {"kind": "random"},
        "gateway": {"host": "127.0.0.1", "transport": "tcp"},
    }
    (run_dir / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    (run_dir / "spec.json").write_text(json.dumps(payload_spec(nbytes).to_dict()))
    endpoints = {
        "gateway": {name: f"tcp://127.0.0.1:{_free_port()}" for name in ("workers", "clients", "control")}
    }
    (run_dir / "endpoints.json").write_text(json.dumps(endpoints))
    return endpoints


def measure_gateway(
    tmp: Path, nbytes: int, warmup: int, steps: int, cpus: tuple[set[int], set[int]]
) -> dict[str, np.ndarray]:
    """Round trips of the product's EnvWorker through a real gateway process."""
    run_dir = tmp / "run"
    endpoints = write_run(run_dir, nbytes)
    out = tmp / "gateway.npz"
    hub = ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)]
    hub += ["--spec", str(run_dir / "spec.json"), "--log-level", "INFO"]
    with Processes(tmp / "logs") as procs:
        procs.python("gateway", "gateway.hub", *hub, cpus=cpus[0])
        worker = ["worker", *_client_args(endpoints["gateway"]["workers"], nbytes, warmup, steps, out)]
        procs.python("worker", "benchmarks.rtt_peers", *worker, cpus=cpus[1])
        procs.wait("worker", WAIT_S)
        procs.check_alive("gateway")
    return _load(out)


def run(quick: bool, repeats: int) -> list[Record]:
    """Measure every size ``repeats`` times, the sides interleaved."""
    cpus = split_placement()
    placement = f"server on cpu {describe_cpus(cpus[0])}, client on cpu {describe_cpus(cpus[1])}"
    records: list[Record] = []
    for label, nbytes in SIZES.items():
        warmup, steps = _steps(quick, nbytes)
        per: dict[str, dict[str, list[float]]] = {
            side: {"rtt_p50_us": [], "rtt_p99_us": [], "loop_p50_us": []} for side in SIDES
        }
        measures = {"zmq": measure_zmq, "gateway": measure_gateway, "unix": measure_unix}
        for rep in range(repeats):
            first = rep % len(SIDES)
            for side in SIDES[first:] + SIDES[:first]:
                with tempfile.TemporaryDirectory(prefix=f"loopgate-bench-{side}-") as tmp:
                    data = measures[side](Path(tmp), nbytes, warmup, steps, cpus)
                rtt, period = data["rtt_us"], data["period_us"]
                per[side]["rtt_p50_us"].append(float(np.percentile(rtt, 50)))
                per[side]["rtt_p99_us"].append(float(np.percentile(rtt, 99)))
                per[side]["loop_p50_us"].append(float(np.nanpercentile(period, 50)))
                log.info(
                    "%s %s repeat %d: p50 %.1f us, p99 %.1f us",
                    side,
                    label,
                    rep + 1,
                    per[side]["rtt_p50_us"][-1],
                    per[side]["rtt_p99_us"][-1],
                )
        note = f"{steps} steps after {warmup} warm-up, {placement}"
        for metric in ("rtt_p50_us", "rtt_p99_us", "loop_p50_us"):
            base = f"zmq.{metric}.{label}"
            records.append(Record.median_of(base, per["zmq"][metric], "us", note=note))
            for side in ("gateway", "unix"):
                records.append(
                    Record.median_of(
                        f"{side}.{metric}.{label}",
                        per[side][metric],
                        "us",
                        baseline=base,
                        note=SIDE_NOTES.get(side, "") + note,
                        target=TARGET
                        if (side, metric, label) == ("gateway", "rtt_p50_us", TARGET_SIZE)
                        else None,
                    )
                )
    return records
