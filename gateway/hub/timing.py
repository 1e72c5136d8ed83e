"""Where a step's time goes: per-hop latency histograms and sampled step timelines.

The gateway times the hops it sees (capture to gateway from the observation's capture
stamp, spool write, policy, its whole turn) and the worker reports the two only it sees
(the ACTION's way to it, the env step) in its next observation's ``meta["hops_us"]``;
the sink's acknowledgement latency comes from the recorder. Simulators that keep episode
statistics (Isaac Lab's ``extras["log"]``) send them in ``meta["env_log"]``; the newest
value of each is the status's ``env_log``. About once a second one
step is followed from capture to the next observation and written to ``trace.jsonl``
(``loopgate report RUN --trace`` turns those into a Chrome/Perfetto trace).
"""

from __future__ import annotations

import math
import time
from typing import Any

from gateway.hub.state import WorkerSession
from gateway.metrics import Histogram, Hops, MetricsWriter
from gateway.protocol import Message
from gateway.steps import ENV_LOG_MAX, StepInfo

TRACE_EVERY_S = 1.0


class StepTiming:
    """One gateway's hop histograms and its sampled step timelines."""

    def __init__(self, sink_ack: Histogram, trace: MetricsWriter | None) -> None:
        self.hops = Hops()
        self.hops.histograms["sink_ack"] = sink_ack
        self.trace = trace
        self._traced_at = 0.0
        self.env_log: dict[str, float] = {}
        """The newest value of each statistic the simulators report (``meta.env_log``:
        Isaac Lab's ``extras["log"]``), as the status and metrics show them."""

    def observation(self, session: WorkerSession, msg: Message, info: StepInfo, t_received: float) -> None:
        """An observation arrived: its way here, what its worker reports of the previous
        action, and the trace of a sampled step (completed now, or started)."""
        if len(info):
            self.hops.add("capture_to_gateway", (t_received - float(info.t_capture[0])) * 1e6)
        self._env_log(msg.meta.get("env_log"))
        reported = msg.meta.get("hops_us")
        if isinstance(reported, dict):
            for hop in ("action_to_worker", "env_step"):
                value = reported.get(hop)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.hops.add(hop, float(value))
        if self.trace is None:
            return
        done, session.trace = session.trace, None
        if done is not None and "t_action" in done and isinstance(reported, dict):
            self.trace.emit({**done, "t_next": t_received, **{f"{k}_us": v for k, v in reported.items()}})
        if t_received - self._traced_at >= TRACE_EVERY_S and len(info):
            self._traced_at = t_received
            session.trace = {
                "worker": session.uid,
                "seq": msg.seq,
                "envs": session.num_envs,
                "t_capture": float(info.t_capture[0]),
                "t_received": t_received,
            }

    def _env_log(self, stats: object) -> None:
        """Keep a worker's reported statistics; anything not a short name and a finite number is skipped."""
        if not isinstance(stats, dict):
            return
        for name, value in list(stats.items())[:ENV_LOG_MAX]:
            if (
                isinstance(name, str)
                and 0 < len(name) <= 100
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
                and (name in self.env_log or len(self.env_log) < ENV_LOG_MAX)
            ):
                self.env_log[name] = float(value)

    def action(self, session: WorkerSession, seq: int) -> None:
        """The ACTION for ``session``'s observation ``seq`` leaves (at ``session.t_action``)."""
        policy_us = (time.perf_counter() - session.t_submitted) * 1e6 if session.submitted else None
        if policy_us is not None:
            self.hops.add("policy", policy_us)
        if not session.held:  # a held observation's wait is the hold, not the data path
            self.hops.add("gateway", (session.t_action - session.t_received) * 1e6)
        trace: dict[str, Any] | None = session.trace
        if trace is not None and trace["seq"] == seq:
            trace["t_action"] = session.t_action
            if policy_us is not None:
                trace["policy_us"] = round(policy_us, 1)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
