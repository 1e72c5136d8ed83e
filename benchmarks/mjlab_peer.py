"""The raw side of the mjlab benchmark: mjlab stepped directly, in mjlab's own venv.

Run by :mod:`benchmarks.mjlab` with ``.venv-mjlab/bin/python -m benchmarks.mjlab_peer
--num-envs N``; it builds one ``ManagerBasedRlEnv`` (what the ``mjlab`` backend wraps),
resets it, prints ``ready``, then answers each line ``measure WARMUP WINDOW`` on stdin with
one JSON line ``{"steps_per_s": ...}``: env steps per second of ``env.step`` with random
actions in ``[-1, 1]`` (torch, on the env's device), counted over WINDOW seconds after
WARMUP seconds of stepping. Between requests it waits on stdin and uses no CPU, so the
gateway side can be measured alone. It ends at end of input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mjlab_peer", description=__doc__)
    p.add_argument("--num-envs", type=int, required=True)
    p.add_argument("--task", default="Mjlab-Cartpole-Balance")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    out = sys.stdout
    sys.stdout = sys.stderr  # mjlab prints its tables; stdout carries only this protocol
    import mjlab.tasks  # noqa: F401 - registers the tasks
    import torch
    from mjlab.envs import ManagerBasedRlEnv
    from mjlab.tasks.registry import load_env_cfg

    cfg = load_env_cfg(args.task)
    cfg.scene.num_envs = args.num_envs
    cfg.seed = 0
    env = ManagerBasedRlEnv(cfg, device=args.device)
    env.reset(seed=0)
    dim = env.single_action_space.shape[0]
    gen = torch.Generator(device=args.device).manual_seed(0)

    def step() -> None:
        action = torch.rand((args.num_envs, dim), generator=gen, device=args.device) * 2 - 1
        env.step(action)

    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        parts = line.split()
        if len(parts) != 3 or parts[0] != "measure":
            out.write(json.dumps({"error": f"expected 'measure WARMUP WINDOW', got {line.strip()!r}"}) + "\n")
            out.flush()
            continue
        warmup, window = float(parts[1]), float(parts[2])
        end = time.perf_counter() + warmup
        while time.perf_counter() < end:
            step()
        steps, t0 = 0, time.perf_counter()
        while True:
            step()
            steps += 1
            now = time.perf_counter()
            if now - t0 >= window:
                break
        out.write(json.dumps({"steps_per_s": steps * args.num_envs / (now - t0)}) + "\n")
        out.flush()
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
