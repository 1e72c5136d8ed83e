"""How late a bare process wakes on this machine now: the floor under every latency record.

A process in a session of its own (as every loopgate service runs) sleeps 10 ms again
and again and prints, as one JSON line, how much later than asked it woke (ms)::

    python -m benchmarks.sched_probe 5
    {"n": 480, "p50_ms": 0.1, "p90_ms": 0.3, "p99_ms": 1.2, "max_ms": 2.0}

On an idle machine that is a fraction of a millisecond; on one whose cores are all busy
it is the time a woken process waits for a core, and a request that crosses several
processes (a browser's e-stop: its page, the browser, its network service, the console,
the gateway and back) waits that long at each.
"""

from __future__ import annotations

import json
import sys
import time

SLEEP_S = 0.01


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank), as the latency records use it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def measure(seconds: float) -> dict[str, float]:
    late: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        time.sleep(SLEEP_S)
        late.append((time.monotonic() - t0 - SLEEP_S) * 1000.0)
    result = {f"p{q}_ms": percentile(late, q) for q in (50, 90, 99)}
    return {"n": len(late), **result, "max_ms": max(late)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(json.dumps(measure(float(args[0]) if args else 5.0)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
