"""Recording demonstrations at the console: takes, labels, and where they are stored.

A *take* is a span of one env's steps, from "Start recording" to "Stop recording",
usually while an operator teleoperates it. Where it starts and stops comes from the
env's newest observation on its worker's tap (its episode and step); the steps
themselves are already on their way to the replay service as online steps. "Stop
recording" asks the replay service to copy the take into its ``demos`` tables
(:mod:`trainer.replay.demos`, the ``demo`` command) with the take's label::

    rec = Recorder(replay_control_address)
    rec.start("w0", env=1, episode=3, step=17)
    rec.mark("success", "clean reach", episode=4, step=41)   # live: a reward label on step 41
    result = rec.stop(episode=4, step=42)                     # waits until stored
    rec.rerecord(...)                                         # discard the take, start again

"Mark success" and "Mark failure" label the take being recorded (the last one wins)
with an optional note; "Mark success" also labels the current step a success (its
``success`` flag, and ``reward`` when ``mark_reward`` is set), the live reward label
HIL-SERL's reward classifiers learn from. "Re-record" drops the take (nothing is stored
as a demonstration; its steps stay online steps) and starts a new one at once.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.trajectory import episode_id

DEMO_TIMEOUT_S = 40.0
"""How long "Stop recording" waits for the replay service to store the take."""
MAX_NOTE = 500


class RecordingError(ValueError):
    """A recording request that cannot be done now; the text goes back to the page."""


@dataclass
class Take:
    take: str
    worker: str
    env: int
    episode: int
    step: int
    label: str | None = None
    note: str = ""
    success_steps: dict[str, list[int]] = field(default_factory=dict)
    started: float = field(default_factory=time.time)


def check_note(note: Any) -> str:
    if note is None:
        return ""
    if not isinstance(note, str) or len(note) > MAX_NOTE:
        raise RecordingError(f"the note must be text of at most {MAX_NOTE} characters")
    return note


def spans(take: Take, episode: int, step: int) -> list[dict[str, Any]]:
    """The take's steps per episode, from its start to (not including) ``step`` of ``episode``."""
    if episode < take.episode or (episode == take.episode and step <= take.step):
        raise RecordingError("nothing recorded yet: the env has not stepped since the take started")
    out = []
    for n in range(take.episode, episode + 1):
        first = take.step if n == take.episode else 0
        last = None if n < episode else step - 1
        if last is not None and last < first:
            continue  # the env stopped right at the start of a new episode
        out.append(
            {"episode_id": episode_id(take.worker, take.env, n), "first_step": first, "last_step": last}
        )
    return out


class Recorder:
    """The console's one recording at a time, stored through the replay service's control socket."""

    def __init__(self, replay_control: str | None, *, mark_reward: float | None = None) -> None:
        self.replay_control = replay_control
        self.mark_reward = mark_reward
        self.take: Take | None = None
        self.last: dict[str, Any] | None = None
        """What the replay service said about the last take stored."""
        self._lock = threading.Lock()

    def state(self) -> dict[str, Any]:
        with self._lock:
            take = self.take
            return {
                "recording": take is not None,
                "take": take.take if take else None,
                "worker": take.worker if take else None,
                "env": take.env if take else None,
                "label": take.label if take else None,
                "last": self.last,
            }

    def start(self, worker: str, env: int, episode: int, step: int) -> dict[str, Any]:
        if self.replay_control is None:
            raise RecordingError("recording needs the replay service: set replay.enabled in the run's config")
        with self._lock:
            if self.take is not None:
                raise RecordingError(f"already recording take {self.take.take}: stop or re-record it first")
            self.take = Take(f"t{int(time.time())}-{secrets.token_hex(3)}", worker, env, episode, step)
            return {"take": self.take.take, "episode": episode, "step": step}

    def mark(self, label: Any, note: Any, episode: int, step: int) -> dict[str, Any]:
        if label not in ("success", "failure"):
            raise RecordingError(f"label must be success or failure, got {label!r}")
        note = check_note(note)
        with self._lock:
            take = self.take
            if take is None:
                raise RecordingError("start recording first: labels go with the take being recorded")
            take.label, take.note = label, note or take.note
            if label == "success":
                take.success_steps.setdefault(episode_id(take.worker, take.env, episode), []).append(step)
            return {"take": take.take, "label": label, "step": step}

    def discard(self) -> str | None:
        with self._lock:
            take, self.take = self.take, None
            return take.take if take else None

    def stop(self, episode: int, step: int, note: Any = None, client: Any = None) -> dict[str, Any]:
        """End the take and store it; returns the replay service's answer (raises
        :class:`RecordingError` with the reason when it could not)."""
        note = check_note(note)
        with self._lock:
            take = self.take
            if take is None:
                raise RecordingError("not recording")
            request = {
                "take": take.take,
                "episodes": spans(take, episode, step),
                "label": take.label,
                "note": note or take.note,
                "success_steps": take.success_steps,
                "mark_reward": self.mark_reward,
                "wait_s": DEMO_TIMEOUT_S - 5.0,
            }
            self.take = None
        result = self._store(request, client)
        with self._lock:
            self.last = result
        return result

    def _store(self, request: dict[str, Any], client: Any) -> dict[str, Any]:
        from gateway.control_client import ControlClient
        from gateway.protocol import RemoteError, Timeout

        assert self.replay_control is not None
        own = client is None
        client = client or ControlClient(self.replay_control)
        try:
            reply: dict[str, Any] = client.request("demo", timeout_s=DEMO_TIMEOUT_S, **request)
        except (Timeout, RemoteError) as exc:
            raise RecordingError(f"the replay service did not store take {request['take']}: {exc}") from None
        finally:
            if own:
                client.close()
        if "error" in reply:
            raise RecordingError(f"the replay service did not store take {request['take']}: {reply['error']}")
        return reply
