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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("loopgate.gpu_bench")

BATCHES = (1, 8, 64, 256)


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
