"""Demonstrations recorded at the web console: a take's steps copied into ``demos`` tables.

The console's "Start recording" / "Stop recording" marks a span of one env's steps (a
*take*: the rest of the episode it started in, the episodes after it, and the current
one up to the last step). The replay service already stores those steps as online
chunks; the control command ``demo`` copies them, labelled, into chunks of their own
with ``source: demos``, so they reach every ``source: demos`` table and the exports
(``loopgate export RUN --demos``) with their labels::

    {"cmd": "demo", "take": "t-1764601234-ab12", "label": "success", "note": "clean grasp",
     "episodes": [{"episode_id": "w0-1-3", "first_step": 17, "last_step": null},
                  {"episode_id": "w0-1-4", "first_step": 0, "last_step": 41}],
     "success_steps": {"w0-1-4": [41]}}

``last_step`` null: through the end of that episode. A take's steps can still be on
their way (the gateway sends an episode's steps in chunks), so the command waits for
them, up to ``wait_s``. Each demo episode is ``demo:console:<take>:<episode_id>``; its
chunk meta carries ``label`` (``success``, ``failure`` or null), ``note``, ``take`` and
``success_steps`` (the steps the operator marked successful live: their ``success``
flag is set and, when ``mark_reward`` is given, their reward too). A take cut before
its episode ended ends ``truncated`` with the next step's observation as final
observation, so its last step still becomes a transition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.protocol import ErrorCode, Message, MsgType, ProtocolError, pack
from gateway.trajectory import STEP_FIELDS, assemble_episodes, chunk_id

LABELS = (None, "success", "failure")
MAX_NOTE = 500
MAX_EPISODES = 1000


@dataclass(frozen=True)
class Span:
    episode_id: str
    first_step: int
    last_step: int | None


@dataclass(frozen=True)
class DemoRequest:
    take: str
    spans: list[Span]
    label: str | None = None
    note: str = ""
    success_steps: dict[str, list[int]] = field(default_factory=dict)
    mark_reward: float | None = None


def _bad(text: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, f"demo: {text}")


def _int(value: Any, what: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(f"{what} must be an integer >= 0{' or null' if optional else ''}, got {value!r}")
    return value


def parse_request(meta: dict[str, Any]) -> DemoRequest:
    """A validated :class:`DemoRequest` from the command's meta, else BAD_REQUEST naming the field."""
    take = meta.get("take")
    if not isinstance(take, str) or not take or len(take) > 100 or ":" in take:
        raise _bad(f"take must be a non-empty id without ':' (at most 100 characters), got {take!r}")
    label = meta.get("label")
    if label not in LABELS:
        raise _bad(f"label must be one of {LABELS}, got {label!r}")
    note = meta.get("note") or ""
    if not isinstance(note, str) or len(note) > MAX_NOTE:
        raise _bad(f"note must be text of at most {MAX_NOTE} characters")
    episodes = meta.get("episodes")
    if not isinstance(episodes, list) or not 0 < len(episodes) <= MAX_EPISODES:
        raise _bad(f"episodes must be a list of 1..{MAX_EPISODES} spans")
    spans = []
    for i, span in enumerate(episodes):
        if not isinstance(span, dict) or not isinstance(span.get("episode_id"), str):
            raise _bad(f"episodes[{i}] must be {{episode_id, first_step, last_step}}")
        first = _int(span.get("first_step"), f"episodes[{i}].first_step")
        last = _int(span.get("last_step"), f"episodes[{i}].last_step", optional=True)
        assert first is not None
        if last is not None and last < first:
            raise _bad(f"episodes[{i}]: last_step {last} is before first_step {first}")
        spans.append(Span(span["episode_id"], first, last))
    marks = meta.get("success_steps") or {}
    if not isinstance(marks, dict) or not all(
        isinstance(v, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in v)
        for v in marks.values()
    ):
        raise _bad("success_steps must map episode ids to lists of step indices")
    reward = meta.get("mark_reward")
    if reward is not None and (not isinstance(reward, (int, float)) or isinstance(reward, bool)):
        raise _bad(f"mark_reward must be a number or null, got {reward!r}")
    return DemoRequest(
        take=take,
        spans=spans,
        label=label,
        note=note,
        success_steps={str(k): list(v) for k, v in marks.items()},
        mark_reward=None if reward is None else float(reward),
    )


def take_chunks(request: DemoRequest, chunks_of: Any) -> list[Message] | str:
    """The take's demo chunks, or what is still missing (the caller waits and asks again).

    ``chunks_of(episode_id, first, last)`` gives the stored online chunks of an episode
    holding any of steps ``first..last`` (``last`` None: to the episode's end)."""
    out: list[Message] = []
    for span in request.spans:
        upto = None if span.last_step is None else span.last_step + 1  # the next observation too
        episodes = assemble_episodes(chunks_of(span.episode_id, span.first_step, upto))
        if not episodes:
            return f"no steps of episode {span.episode_id} stored yet"
        ep = episodes[0]
        steps = ep.arrays["step"]
        ended = ep.end is not None
        last = span.last_step
        if last is None:
            if not ended:
                return f"episode {span.episode_id} has not ended yet"
            last = int(steps[-1])
        need = last if ended and last >= int(steps[-1]) else last + 1  # the next obs too
        have = set(steps.tolist())
        missing = [s for s in range(span.first_step, need + 1) if s not in have]
        if missing:
            return f"episode {span.episode_id}: steps {missing[0]}..{missing[-1]} not stored yet"
        keep = (steps >= span.first_step) & (steps <= last)
        arrays = {k: np.asarray(v)[keep] for k, v in ep.arrays.items() if not k.startswith("final_obs/")}
        marked = np.isin(arrays["step"], request.success_steps.get(span.episode_id, []))
        if marked.any():
            arrays["success"] = arrays["success"] | marked
            if request.mark_reward is not None:
                arrays["reward"] = np.where(marked, np.float32(request.mark_reward), arrays["reward"])
        if ended and last >= int(steps[-1]):
            end = ep.end
            final = {k[len("final_obs/") :]: v for k, v in ep.arrays.items() if k.startswith("final_obs/")}
        else:  # cut by the operator: the next step's observation closes it
            end = "truncated"
            after = int(np.flatnonzero(steps == last + 1)[0])
            final = {
                k[4:]: np.asarray(v)[after : after + 1] for k, v in ep.arrays.items() if k.startswith("obs/")
            }
            arrays["truncated"] = arrays["truncated"].copy()
            arrays["truncated"][-1] = True
        if end == "interrupted":
            final = {}
        demo_id = f"demo:console:{request.take}:{span.episode_id}"
        for key, dtype in STEP_FIELDS.items():
            arrays[key] = np.asarray(arrays[key], dtype)
        arrays.update(pack("final_obs", final))
        meta = {k: v for k, v in ep.meta.items() if k not in ("episode_id", "end", "source")}
        meta.update(
            chunk_id=chunk_id(demo_id, span.first_step),
            episode_id=demo_id,
            first_step=span.first_step,
            num_steps=int(keep.sum()),
            final=True,
            end=end,
            eval=False,
            source="demos",
            take=request.take,
            label=request.label,
            note=request.note,
            success_steps=[int(s) for s in arrays["step"][marked]],
            recorded_from=span.episode_id,
        )
        out.append(Message(MsgType.TRAJECTORY_CHUNK, meta=meta, arrays=arrays))
    return out
