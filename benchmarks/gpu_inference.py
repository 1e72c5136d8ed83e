"""GPU figures of the inference backends, for a machine with an NVIDIA GPU.

Runs the product's own backends (:mod:`inference.backends`) in this process
on the reach actor (MLP ``--hidden``) at batch 1, 8, 64 and 256, with the CPU versions
as the baseline measured in the same run:

- ``torch_eager``: torch on ``cuda``, eager;
- ``torch_graphs``: torch on ``cuda`` with one CUDA graph per batch bucket;
- ``ort_cuda``: onnxruntime's CUDA execution provider with IOBinding;
- ``ort_tensorrt``: onnxruntime's TensorRT provider (CUDA as its fallback), if present;
- ``torch_cpu`` / ``ort_cpu``: the same model on the CPU (baselines).

For each it reports latency per forward pass (p50, p99, µs) and rows per second, and
the largest difference of its actions from torch on the CPU. On a machine without a
CUDA device it says so and exits 0 without measuring anything::

    python -m benchmarks.gpu_inference --json gpu.json
    python -m benchmarks.gpu_inference --hidden 2048,2048 --iters 500 --json gpu.json

It is also the ``gpu`` suite of ``loopgate bench`` (:func:`suite`): CUDA IPC
(:mod:`gateway.cuda_ipc`) against the host path on one GPU, each with its baseline
measured in the same run against the same server process:

- ``weights.sync_s.<size>.cuda_ipc`` against ``weights.sync_s.<size>.host`` (1M, 10M and
  100M parameters; ``--quick``: the first two): a state dict of CUDA tensors published to
  a torch inference server on the same GPU until it acknowledges (copied device to
  device there, validated, swapped), against the same tensors as host buckets (copied to
  the host, sent, copied back to the device). Steady state: the first
  ``WARMUP_PUBLICATIONS`` of each are not timed.
- ``obs.infer_us.n4096.cuda_ipc`` against ``obs.infer_us.n4096.host``: the p50 round trip
  of one INFER of 4096 torch-reach observations (f32[4096, 15]) computed on the GPU, as
  the gateway sends it: a handle to the worker's ring slot (the copy into it and its
  event included) against the host arrays the worker made for recording anyway.
  ``obs.request_bytes.n4096.*`` are the bytes of those requests on the socket.

Without CUDA the suite logs why and returns no records::

    loopgate bench --only gpu --json gpu-bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("loopgate.gpu_bench")

BATCHES = (1, 8, 64, 256)
NAMES: tuple[str, ...] = (
    *(f"weights.sync_s.{s}.{p}" for s in ("1M", "10M", "100M") for p in ("host", "cuda_ipc")),
    *(f"obs.{m}.n4096.{p}" for m in ("infer_us", "request_bytes") for p in ("host", "cuda_ipc")),
)
"""The ``gpu`` suite's records (:func:`suite`)."""


def gpu_status() -> tuple[bool, bool, list[str], str]:
    """(torch sees CUDA, onnxruntime has a GPU provider, ort providers, why not)."""
    reasons = []
    try:
        import torch

        torch_cuda = bool(torch.cuda.is_available())
        if not torch_cuda:
            reasons.append(f"torch {torch.__version__} sees no CUDA device")
    except ImportError:
        torch_cuda = False
        reasons.append("torch is not installed")
    try:
        import onnxruntime as ort

        providers = list(ort.get_available_providers())
    except ImportError:
        providers = []
        reasons.append("onnxruntime is not installed")
    ort_gpu = "CUDAExecutionProvider" in providers and torch_cuda
    if "CUDAExecutionProvider" not in providers:
        reasons.append(
            f"onnxruntime has no CUDA provider ({', '.join(providers) or 'none'}; pip install -e '.[gpu]')"
        )
    return torch_cuda, ort_gpu, providers, "; ".join(reasons)


def variants(torch_cuda: bool, ort_gpu: bool, providers: list[str]) -> dict[str, dict[str, Any]]:
    """Config overrides of each measured variant (GPU ones only where they can run)."""
    out: dict[str, dict[str, Any]] = {
        "torch_cpu": {"backend": "torch", "device": "cpu"},
        "ort_cpu": {"backend": "onnxruntime", "device": "cpu", "providers": ("CPUExecutionProvider",)},
    }
    if torch_cuda:
        out["torch_eager"] = {"backend": "torch", "device": "cuda", "cuda_graphs": False}
        out["torch_graphs"] = {"backend": "torch", "device": "cuda", "cuda_graphs": True}
    if ort_gpu:
        out["ort_cuda"] = {
            "backend": "onnxruntime",
            "device": "cuda",
            "providers": ("CUDAExecutionProvider", "CPUExecutionProvider"),
        }
        if "TensorrtExecutionProvider" in providers:
            out["ort_tensorrt"] = {
                "backend": "onnxruntime",
                "device": "cuda",
                "providers": ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
            }
    return out


def measure(
    policy: Any, obs: dict[str, np.ndarray], eps: np.ndarray, iters: int
) -> tuple[np.ndarray, list[float]]:
    for _ in range(max(10, iters // 10)):
        out = policy.run(obs, eps)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = policy.run(obs, eps)  # returns host memory: the copy back is part of the figure
        times.append((time.perf_counter() - t0) * 1e6)
    return out, times


def run(hidden: tuple[int, ...], iters: int, batches: tuple[int, ...]) -> dict[str, Any]:
    from gateway.factory import experiment_spec
    from inference.backends import make_backend
    from inference.config import InferenceConfig
    from networks.config import NetworkConfig

    torch_cuda, ort_gpu, providers, why = gpu_status()
    if not (torch_cuda or ort_gpu):
        return {"skipped": f"no GPU to measure: {why}"}
    spec = experiment_spec("mujoco_reach", {})
    base = InferenceConfig(network=NetworkConfig(hidden_sizes=hidden), max_batch=max(batches),
                           batch_buckets=tuple(sorted(batches)), threads=0, init_seed=0)  # fmt: skip
    rng = np.random.default_rng(0)
    inputs = {
        b: ({k: rng.standard_normal((b, *a.shape)).astype(a.dtype) for k, a in spec.observation.items()},
            np.zeros((b, *spec.action.shape), np.float32))
        for b in batches
    }  # fmt: skip
    reference: dict[int, np.ndarray] = {}
    rows: list[dict[str, Any]] = []
    for name, overrides in variants(torch_cuda, ort_gpu, providers).items():
        try:
            backend = make_backend(spec, dataclasses.replace(base, **overrides))
            policy = backend.initial()
        except Exception as exc:  # a provider that is listed but cannot start (drivers, TensorRT libs)
            log.warning("%s: cannot start: %s", name, exc)
            rows.append({"variant": name, "skipped": str(exc)})
            continue
        info = backend.describe()
        for b in batches:
            out, times = measure(policy, *inputs[b], iters)
            if name == "torch_cpu":
                reference[b] = out
            p50 = float(np.percentile(times, 50))
            row = {
                "variant": name,
                "batch": b,
                "p50_us": round(p50, 1),
                "p99_us": round(float(np.percentile(times, 99)), 1),
                "rows_per_s": round(b / (p50 / 1e6), 1),
                "max_abs_diff_vs_torch_cpu": float(np.abs(out - reference[b]).max())
                if b in reference
                else None,
                "device": info.get("device"),
                "providers": info.get("providers"),
            }
            rows.append(row)
            log.info("%-13s b%-4d p50 %9.1f us  p99 %9.1f us  %12.0f rows/s", name, b, row["p50_us"],
                     row["p99_us"], row["rows_per_s"])  # fmt: skip
    return {"hidden": list(hidden), "iters": iters, "providers": providers, "results": rows}


def suite(quick: bool, repeats: int) -> list[Any]:
    """The ``gpu`` suite: CUDA IPC against host copies for weights and observations on one
    GPU; no records (and one log line saying why) without CUDA."""
    from gateway.cuda_ipc import why_unavailable

    why = why_unavailable()
    if why is not None:
        log.warning("skipping the GPU suite (CUDA IPC records): %s", why)
        return []
    from benchmarks.procs import Processes
    from benchmarks.trainer import WARMUP_PUBLICATIONS, WEIGHT_SIZES

    sizes = ["1M", "10M"] if quick else list(WEIGHT_SIZES)
    reps = max(3, repeats)
    records: list[Any] = []
    with (
        tempfile.TemporaryDirectory(prefix="loopgate-bench-gpu-") as tmp_name,
        Processes(Path(tmp_name) / "logs") as procs,
    ):
        tmp = Path(tmp_name)
        for label in sizes:
            figures = _weights(procs, tmp, label, WEIGHT_SIZES[label], reps, WARMUP_PUBLICATIONS)
            records += _pair(
                "weights.sync_s",
                label,
                figures,
                "s",
                f"{label} parameters, torch server on the same GPU, acked; median of {reps}",
            )
        figures, sizes_b = _observations(procs, tmp, 50 if quick else 200, reps)
        records += _pair(
            "obs.infer_us",
            "n4096",
            figures,
            "us",
            f"p50 INFER round trip, 4096 x f32[15], MLP {list(OBS_HIDDEN)}; median of {reps}",
        )
        records += _pair(
            "obs.request_bytes",
            "n4096",
            {k: [v] for k, v in sizes_b.items()},
            "B",
            "bytes of one request on the socket",
        )
    return records


OBS_HIDDEN = (256, 256)
OBS_ROWS = 4096


def _pair(metric: str, label: str, figures: dict[str, list[float]], unit: str, note: str) -> list[Any]:
    from benchmarks.records import Record

    host = f"{metric}.{label}.host"
    return [
        Record.median_of(host, figures["host"], unit, note=note),
        Record.median_of(f"{metric}.{label}.cuda_ipc", figures["cuda_ipc"], unit, baseline=host, note=note),
    ]


def _server(procs: Any, tmp: Path, name: str, env: dict[str, Any], **inference: Any) -> dict[str, str]:
    """A torch inference server on ``cuda`` (``python -m inference``); its addresses."""
    from benchmarks.inference import wait_until

    run = tmp / name
    run.mkdir()
    config = {"env": env, "inference": {"backend": "torch", "device": "cuda", **inference}}
    (run / "config.yaml").write_text(json.dumps(config))
    procs.python(
        name,
        "inference",
        "--config",
        str(run / "config.yaml"),
        "--run-dir",
        str(run),
        "--log-level",
        "WARNING",
    )
    endpoints = run / "endpoints.json"
    wait_until(lambda: endpoints.exists() or procs.check_alive(name), 180, f"{name} to serve")
    return dict(json.loads(endpoints.read_text())["inference"][0])


def _weights(
    procs: Any, tmp: Path, label: str, hidden: tuple[int, ...], reps: int, warmup: int
) -> dict[str, list[float]]:
    """Publication times of the same device state dict by handle and by host buckets, interleaved."""
    import torch

    from gateway.factory import experiment_spec
    from inference.weights import WeightsPublisher
    from networks.config import NetworkConfig
    from networks.modules import make_actor

    spec = experiment_spec("mujoco_reach", {})
    addresses = _server(
        procs, tmp, f"weights-{label}", {"backend": "mujoco_reach"}, network={"hidden_sizes": list(hidden)}
    )
    actor = make_actor(spec, NetworkConfig(hidden_sizes=hidden), seed=1).cuda()
    state = {k: v.detach().clone() for k, v in actor.state_dict().items()}
    publishers = {
        "cuda_ipc": WeightsPublisher([addresses], timeout_s=300.0),
        "host": WeightsPublisher([addresses], timeout_s=300.0, cuda_ipc=False),
    }
    figures: dict[str, list[float]] = {"cuda_ipc": [], "host": []}
    version = 0
    try:
        for i in range(warmup + reps):
            for path in ("cuda_ipc", "host") if i % 2 == 0 else ("host", "cuda_ipc"):
                version += 1
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                publishers[path].publish(state, version)
                elapsed = time.perf_counter() - t0
                if publishers[path].formats != ["cuda_ipc" if path == "cuda_ipc" else "state_dict"]:
                    raise RuntimeError(
                        f"{path} publication went as {publishers[path].formats}: the server declared no GPU?"
                    )
                if i >= warmup:
                    figures[path].append(elapsed)
            log.info("weights %s: %s", label, {k: round(v[-1], 4) for k, v in figures.items() if v})
    finally:
        for publisher in publishers.values():
            publisher.close()
        procs.stop(f"weights-{label}")
    return figures


def _observations(
    procs: Any, tmp: Path, requests: int, reps: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """p50 INFER round trips (µs) of 4096 GPU observations by handle and as host arrays."""
    import torch
    import zmq

    from gateway.cuda_handles import RingOffer
    from gateway.cuda_ipc import CudaRing
    from gateway.protocol import Message, MsgType, encode, pack, recv, send

    addresses = _server(
        procs,
        tmp,
        "obs",
        {"backend": "torch_reach", "options": {"device": "cuda"}},
        network={"hidden_sizes": list(OBS_HIDDEN)},
        max_batch=OBS_ROWS,
        batch_buckets=[OBS_ROWS],
        max_wait_us=0,
    )
    ring = CudaRing.create({"policy": ("float32", (OBS_ROWS, 15))}, "cuda:0")
    offer = RingOffer.parse(ring.offer())
    device_obs = torch.randn(OBS_ROWS, 15, device="cuda:0")
    host_obs = {"policy": device_obs.cpu().numpy()}  # the worker's copy for recording
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(addresses["requests"])
    seq = 0

    def request(path: str) -> Message:
        nonlocal seq
        seq += 1
        if path == "host":
            return Message(MsgType.INFER, seq=seq, meta={"deadline_ms": 5000}, arrays=pack("obs", host_obs))
        handle = offer.handle(ring.write(seq, {"policy": device_obs}))
        return Message(MsgType.INFER, seq=seq, meta={"deadline_ms": 5000, "cuda_ipc": handle})

    def round_trip(path: str) -> float:
        t0 = time.perf_counter()
        send(sock, request(path))
        if not sock.poll(30_000):
            raise TimeoutError("the inference server did not answer")
        answer = recv(sock)
        if answer.type is not MsgType.ACTION:
            raise RuntimeError(f"{path} request refused: {answer.meta}")
        return (time.perf_counter() - t0) * 1e6

    figures: dict[str, list[float]] = {"cuda_ipc": [], "host": []}
    try:
        for rep in range(reps + 1):  # the first is warm-up
            for path in ("cuda_ipc", "host") if rep % 2 == 0 else ("host", "cuda_ipc"):
                times = [round_trip(path) for _ in range(requests)]
                if rep:
                    figures[path].append(float(np.percentile(times, 50)))
            log.info("observations: %s", {k: round(v[-1], 1) for k, v in figures.items() if v})
        sizes = {p: float(sum(len(bytes(f)) for f in encode(request(p)))) for p in ("host", "cuda_ipc")}
    finally:
        sock.close()
        ring.close()
        procs.stop("obs")
    return figures, sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_inference",
        description="Latency and throughput of the inference backends on a CUDA GPU (skips without one).",
        epilog="example: python -m benchmarks.gpu_inference --json gpu.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", help="write the figures (or the reason for skipping) to FILE")
    p.add_argument("--hidden", default="1024,1024", help="MLP hidden sizes, comma-separated")
    p.add_argument("--iters", type=int, default=300, help="timed forward passes per batch size")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    hidden = tuple(int(v) for v in args.hidden.split(","))
    batches = tuple(int(v) for v in args.batches.split(","))
    result = run(hidden, args.iters, batches)
    if "skipped" in result:
        log.warning("skipped: %s", result["skipped"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
