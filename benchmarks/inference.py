"""Inference servers: throughput and latency against batch size, clients, peers; weight swaps.

Every measurement uses one model: the reach actor with an MLP of ``MODEL_HIDDEN``
(exported once to ONNX; every server loads that file). Servers run on the first
allowed CPU, their clients on the second (:func:`~benchmarks.procs.split_placement`);
clients run closed loops (send one request, wait for its answer), each over its own
connection, all in one asyncio load-generating process (many client processes would
measure the scheduling of one shared core more than the servers); only requests inside
one shared window count.

- **batch size** (``.b1 .b8 .b64 .b256``, one client): rows per second and latency of
  requests of that many rows, for both backends (``inference.*``: onnxruntime,
  ``inference_torch.*``: torch). ``inference.throughput.b64`` has
  ``inference.throughput.b1`` as its baseline.
- **clients** (``.c1 .c4 .c16``, one row per request): the same server with 1, 4 or 16
  concurrent clients, against the same model behind a minimal websocket + msgpack
  server in OpenPI's style (``websocket_peer.*``) and a gRPC unary server
  (``grpc_peer.*``), started from :mod:`benchmarks.inference_peers` in the same run.
- **weight swaps** (``.1M .10M .50M`` parameters): a server with a network of that size
  serves one streaming client while versions are published to it:
  ``inference.swap_ms.<size>`` is publish to WEIGHTS_ACK (transfer, validation, load,
  swap) against ``zmq.weights_send_ms.<size>``, a raw ZeroMQ send of the same bytes;
  ``inference.swap_wait_ms.<size>`` is the longest extra wait of a request that
  overlapped a swap (its latency minus the median outside swaps) against
  ``inference.batch_ms.<size>``, that median (one batch cycle).

    loopgate bench --only inference
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.procs import Processes, describe_cpus, split_placement
from benchmarks.records import Record

log = logging.getLogger(__name__)

MODEL_HIDDEN = (1024, 1024)
"""~1.1 M parameters: big enough that a forward pass is worth sharing."""
BATCHES = (1, 8, 64, 256)
CLIENTS = (1, 4, 16)
SWAP_SIZES: dict[str, tuple[int, ...]] = {
    "1M": (1024, 1024),
    "10M": (2304, 2304, 2304),
    "50M": (4096, 4096, 4096, 4096),
}
"""Hidden sizes giving about 1, 10 and 50 million parameters."""
SIDES = ("inference", "inference_torch", "websocket_peer", "grpc_peer")
MAX_REPEATS = 3
"""The suite runs at most this many repeats (each starts every server afresh)."""

NAMES: tuple[str, ...] = (
    *(f"{s}.{m}.b{b}" for s in SIDES[:2] for m in ("throughput", "latency_p50_us", "latency_p99_us") for b in BATCHES),
    *(f"{s}.{m}.c{c}" for s in SIDES for m in ("throughput", "latency_p50_us", "latency_p99_us") for c in CLIENTS),
    *(f"{name}.{size}" for size in SWAP_SIZES for name in (
        "inference.swap_ms", "zmq.weights_send_ms", "inference.swap_wait_ms", "inference.batch_ms")),
)  # fmt: skip


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    """Poll ``predicate()`` until true; ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


def _free_port() -> int:
    from gateway.services import free_port

    return free_port()


def export_model(path: Path, hidden: tuple[int, ...]) -> None:
    from gateway.factory import experiment_spec
    from networks.modules import NetworkConfig, export_onnx, make_actor

    spec = experiment_spec("mujoco_reach", {})
    path.write_bytes(export_onnx(make_actor(spec, NetworkConfig(hidden_sizes=hidden), seed=0)))


def start_loopgate(procs: Processes, tmp: Path, name: str, backend: str, model: Path | None,
                   hidden: tuple[int, ...], cpus: set[int]) -> dict[str, str]:  # fmt: skip
    """A real inference server (``python -m inference``); its addresses."""
    run = tmp / name
    run.mkdir()
    inference: dict[str, Any] = {"backend": backend, "network": {"hidden_sizes": list(hidden)}, "threads": 1}
    if model is not None:
        inference["weights"] = str(model)
    (run / "config.yaml").write_text(json.dumps({"env": {"backend": "mujoco_reach"}, "inference": inference}))
    procs.python(name, "inference", "--config", str(run / "config.yaml"), "--run-dir", str(run),
                 "--log-level", "WARNING", cpus=cpus)  # fmt: skip
    endpoints = run / "endpoints.json"
    wait_until(lambda: endpoints.exists() or procs.check_alive(name), 180, f"{name} to serve")
    return dict(json.loads(endpoints.read_text())["inference"][0])


def start_peer(procs: Processes, tmp: Path, kind: str, model: Path, cpus: set[int]) -> str:
    port = _free_port()
    ready = tmp / f"{kind}.ready"
    procs.python(f"{kind}-server", "benchmarks.inference_peers", f"{kind}-server", "--port", str(port),
                 "--model", str(model), "--ready", str(ready), cpus=cpus)  # fmt: skip
    wait_until(lambda: ready.exists() or procs.check_alive(f"{kind}-server"), 60, f"the {kind} peer")
    return f"ws://127.0.0.1:{port}" if kind == "websocket" else f"127.0.0.1:{port}"


def drive(procs: Processes, tmp: Path, kind: str, address: str, batch: int, clients: int,
          window_s: float, cpus: set[int]) -> dict[str, Any]:  # fmt: skip
    """``clients`` closed-loop clients (one load-generating process); their figures over one window."""
    tag = f"{kind}-b{batch}-c{clients}-{time.monotonic_ns()}"
    outs = [tmp / f"{tag}.npz"]
    go = tmp / f"{tag}.go"
    procs.python(tag, "benchmarks.inference_peers", "client", "--kind", kind, "--connect", address,
                 "--batch", str(batch), "--clients", str(clients), "--go", str(go), "--out", str(outs[0]),
                 cpus=cpus)  # fmt: skip
    names = [tag]
    wait_until(lambda: all(Path(str(o) + ".ready").exists() or procs.check_alive(n) for o, n in zip(outs, names)),
               120, f"{clients} {kind} clients")  # fmt: skip
    start = time.monotonic() + 0.3  # warm-up: every client is already sending by then
    staging = go.with_suffix(".tmp")
    staging.write_text(json.dumps({"start": start, "stop": start + window_s}))
    staging.replace(go)  # atomically: a client never reads a half-written file
    for n in names:
        procs.wait(n, 60 + window_s)
    latency, sent, rows = [], [], 0
    for out in outs:
        with np.load(out) as data:
            latency.append(data["latency_us"])
            sent.append(data["t_send"])
            rows += int(data["rows"])
    lat = np.concatenate(latency)
    return {
        "throughput": rows / window_s,
        "latency_p50_us": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "latency_p99_us": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "t_send": np.concatenate(sent),
        "latency": lat,
    }


def _keep(figures: dict[str, list[float]], side: str, suffix: str, result: dict[str, Any]) -> None:
    for metric in ("throughput", "latency_p50_us", "latency_p99_us"):
        figures.setdefault(f"{side}.{metric}.{suffix}", []).append(result[metric])


def measure_serving(tmp: Path, model: Path, window_s: float, figures: dict[str, list[float]]) -> None:
    server_cpus, client_cpus = split_placement()
    for side, backend in (("inference", "onnxruntime"), ("inference_torch", "torch")):
        with Processes(tmp / "logs" / side) as procs:
            address = start_loopgate(procs, tmp, f"{side}-{time.monotonic_ns()}", backend, model,
                                     MODEL_HIDDEN, server_cpus)["requests"]  # fmt: skip
            for batch in BATCHES:
                result = drive(procs, tmp, "loopgate", address, batch, 1, window_s, client_cpus)
                _keep(figures, side, f"b{batch}", result)
                if batch == 1:
                    _keep(figures, side, "c1", result)
            for clients in CLIENTS[1:]:
                _keep(figures, side, f"c{clients}", drive(procs, tmp, "loopgate", address, 1, clients,
                                                          window_s, client_cpus))  # fmt: skip
            procs.check_alive(*(n for n in procs.procs if n.startswith(side)))
    for side, kind in (("websocket_peer", "websocket"), ("grpc_peer", "grpc")):
        with Processes(tmp / "logs" / side) as procs:
            address = start_peer(procs, tmp, kind, model, server_cpus)
            for clients in CLIENTS:
                _keep(figures, side, f"c{clients}", drive(procs, tmp, kind, address, 1, clients,
                                                          window_s, client_cpus))  # fmt: skip


def raw_send_ms(arrays: dict[str, np.ndarray], bucket_bytes: int) -> float:
    """Raw ZeroMQ: the same bytes, bucketed the same way, to a ROUTER that acknowledges the last."""
    import threading

    import zmq

    from inference.weights import bucketize

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    buckets = bucketize(arrays, bucket_bytes)

    def sink() -> None:
        for i in range(len(buckets)):
            frames = router.recv_multipart(copy=False)
            if i == len(buckets) - 1:
                router.send_multipart([frames[0], b"ack"])

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        t0 = time.monotonic()
        for bucket, _ in buckets:
            dealer.send_multipart(list(bucket.values()), copy=False)
        if not dealer.poll(60_000):
            raise TimeoutError("raw sink did not acknowledge")
        dealer.recv()
        elapsed = (time.monotonic() - t0) * 1e3
        thread.join(timeout=5)
        return elapsed
    finally:
        dealer.close(linger=0)
        router.close(linger=0)


def _stream_into(result: dict[str, Any], procs: Processes, tmp: Path, address: str, window_s: float,
                 cpus: set[int]) -> None:  # fmt: skip
    """One client streaming batches of 8 for ``window_s`` (run on a thread during swaps)."""
    result.update(drive(procs, tmp, "loopgate", address, 8, 1, window_s, cpus))


def measure_swaps(tmp: Path, publishes: int, figures: dict[str, list[float]]) -> None:
    from gateway.factory import experiment_spec
    from inference.weights import DEFAULT_BUCKET_BYTES, WeightsPublisher
    from networks.modules import NetworkConfig, make_actor, state_dict_numpy

    spec = experiment_spec("mujoco_reach", {})
    server_cpus, client_cpus = split_placement()
    for label, hidden in SWAP_SIZES.items():
        arrays = state_dict_numpy(make_actor(spec, NetworkConfig(hidden_sizes=hidden), seed=1))
        with Processes(tmp / "logs" / f"swap-{label}") as procs:
            addresses = start_loopgate(procs, tmp, f"swap-{label}-{time.monotonic_ns()}", "onnxruntime", None,
                                       hidden, server_cpus)  # fmt: skip
            publisher = WeightsPublisher([addresses], timeout_s=120.0)
            windows: list[tuple[float, float]] = []
            result: dict[str, Any] = {}
            try:
                window_s = 1.0 + publishes * 1.5
                client = threading.Thread(
                    target=_stream_into,
                    args=(result, procs, tmp, addresses["requests"], window_s, client_cpus),
                )
                client.start()
                time.sleep(2.0 + 0.5)  # the client starts and the window opens
                for version in range(1, publishes + 1):
                    t0 = time.monotonic()
                    publisher.publish(arrays, version)
                    windows.append((t0, time.monotonic()))
                    time.sleep(0.5)
                client.join(timeout=180)
            finally:
                publisher.close()
        sent, latency = result["t_send"], result["latency"]
        overlap = np.zeros(len(sent), bool)
        for t0, t1 in windows:
            overlap |= (sent <= t1) & (sent + latency / 1e6 >= t0)
        calm = float(np.median(latency[~overlap])) / 1e3
        during = float(latency[overlap].max()) / 1e3 if overlap.any() else calm
        figures.setdefault(f"inference.swap_ms.{label}", []).extend((t1 - t0) * 1e3 for t0, t1 in windows)
        figures.setdefault(f"inference.swap_wait_ms.{label}", []).append(max(0.0, during - calm))
        figures.setdefault(f"inference.batch_ms.{label}", []).append(calm)
        figures.setdefault(f"zmq.weights_send_ms.{label}", []).append(
            raw_send_ms(arrays, DEFAULT_BUCKET_BYTES)
        )


def records(figures: dict[str, list[float]], note: str, window_s: float) -> list[Record]:
    out: list[Record] = []
    for name, values in figures.items():
        side, metric, point = name.split(".")
        unit = {"throughput": "rows/s", "latency_p50_us": "us", "latency_p99_us": "us"}.get(metric, "ms")
        baseline = target = None
        if name == "inference.throughput.b64":
            baseline, target = "inference.throughput.b1", ">= 10"
        elif side in ("inference", "inference_torch") and metric == "throughput" and point.startswith("c"):
            baseline = f"websocket_peer.throughput.{point}"
            target = ">= 5" if name == "inference.throughput.c16" else None
        elif side == "grpc_peer" and metric == "throughput":
            baseline = f"websocket_peer.throughput.{point}"
        elif side == "inference_torch":
            baseline = f"inference.{metric}.{point}"
        elif metric == "swap_ms":
            baseline = f"zmq.weights_send_ms.{point}"
        elif metric == "swap_wait_ms":
            baseline = f"inference.batch_ms.{point}"
            target = "<= 1" if point == "10M" else None
        how = (
            f"{window_s:g} s windows; {note}"
            if metric in ("throughput", "latency_p50_us", "latency_p99_us")
            else note
        )
        out.append(Record.median_of(name, values, unit, baseline=baseline, target=target, note=how))
    return out


def run(quick: bool, repeats: int) -> list[Record]:
    """Serving figures (both backends and both peers) and swap figures, ``min(repeats, 3)`` times."""
    repeats = min(repeats, MAX_REPEATS)
    window_s = 0.5 if quick else 1.0
    server_cpus, client_cpus = split_placement()
    note = (f"MLP {'x'.join(map(str, MODEL_HIDDEN))}, server on cpu {describe_cpus(server_cpus)}, "
            f"clients on cpu {describe_cpus(client_cpus)}")  # fmt: skip
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="loopgate-bench-inference-") as tmp_name:
        tmp = Path(tmp_name)
        model = tmp / "model.onnx"
        export_model(model, MODEL_HIDDEN)
        for rep in range(repeats):
            started = time.monotonic()
            measure_serving(tmp, model, window_s, figures)
            log.info("inference serving repeat %d done in %.0f s", rep + 1, time.monotonic() - started)
        measure_swaps(tmp, 2 if quick else max(3, repeats), figures)
    return records(figures, note, window_s)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    for record in run(
        quick="--quick" in sys.argv, repeats=int(sys.argv[-1]) if sys.argv[-1].isdigit() else 1
    ):
        log.info(
            "%s = %.1f %s (%s)", record.name, record.value, record.unit, statistics.median(record.repeats)
        )
