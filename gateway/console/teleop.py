"""Teleoperation: an operator's commands checked, limited, and turned into one env's action.

The browser sends, while the operator holds a key, about 20 commands a second::

    {"type": "command", "seq": 17, "t": 1764601234567.0, "env": 0, "axes": [0.0, 1.0, 0.0]}

``axes`` is one value in [-1, 1] per action element; ``t`` is the page's clock in ms.
:func:`parse_command` validates a message, :class:`RateLimiter` drops floods,
:class:`StaleFilter` drops commands that arrive late or out of order, and
:class:`Deadman` decides whether the last command still holds. :class:`TeleopLoop`
attaches to one worker through the gateway's client socket
(:class:`gateway.client.GatewayVectorEnv` with ``takeover=True``) and steps it at the
env's control rate::

    loop = TeleopLoop(address, worker="worker-0", settings=settings)
    loop.start()
    loop.command(parse_command(msg, loop.action_size, loop.num_envs), now)
    loop.hold("window blurred")       # keys up, blur, hidden tab, dropped socket
    loop.release()

The takeover is per env: the operator drives one env of the worker, and the
experiment's own policy (``others``, the action source the gateway uses) keeps driving
the rest, each step (without a policy, ``policy.kind: external``, they hold). Only the
operator's env is flagged ``intervention`` in the trajectory; the others' steps carry
the policy's versions like any policy step.

The hold is enforced here, next to the gateway, not only in the page: with no fresh
command for ``deadman_s`` the loop sends the hold action. :class:`ActionShaper` turns
axes into actions, bumpless in both kinds of action space the spec can declare:

- *deltas* (the default; the reach arm's joint position target deltas): the hold action
  is all zeros, which keeps the current targets;
- *absolute* (``spec.metadata["action_space"] == "absolute"``, with
  ``metadata["command_key"]`` naming the observation that holds the robot's current
  command, e.g. its joint position targets): the hold action is that command as last
  observed, and held axes move it at ``scale`` of half the action's range per second.

Either way the first action after a takeover equals what the robot is already
commanded, so the arm does not jump. Release hands the env back the same way: for
``release_ramp_s`` the loop keeps stepping it, its action blended from the held command
to the policy's, ``(1 - a) * held + a * policy`` with ``a`` rising to 1 (deltas: the
policy's motion fades in from standing still; absolute commands: from where the robot
is held to where the policy points), and the gateway's policy carries on from there.
Those steps are still flagged ``intervention`` (the person's command shapes them). Only
an operator's Release ramps; a hold (deadman, e-stop) and a dropped connection let go
at once, holding.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from gateway.protocol import RemoteError, RunEnded, Timeout

log = logging.getLogger(__name__)


POLICY_WAIT_S = 0.5
"""How long a step waits for the policy's actions for the envs the operator does not drive."""


class CommandError(ValueError):
    """A control message that does not fit; the text goes back to the page."""


@dataclass(frozen=True)
class Command:
    seq: int
    t_ms: float
    env: int
    axes: tuple[float, ...]


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_command(msg: Any, action_size: int, num_envs: int) -> Command:
    """A validated :class:`Command`, or :class:`CommandError` saying what is wrong."""
    if not isinstance(msg, dict):
        raise CommandError("a command must be a JSON object")
    seq, t, env, axes = msg.get("seq"), msg.get("t"), msg.get("env"), msg.get("axes")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise CommandError(f"seq must be a non-negative integer, got {seq!r}")
    if not _number(t):
        raise CommandError(f"t must be a finite number (ms), got {t!r}")
    if not isinstance(env, int) or isinstance(env, bool) or not 0 <= env < num_envs:
        raise CommandError(f"env must be an integer in 0..{num_envs - 1}, got {env!r}")
    if not isinstance(axes, list) or len(axes) != action_size:
        raise CommandError(f"axes must be a list of {action_size} numbers, got {axes!r}")
    if not all(_number(a) and -1.0 <= a <= 1.0 for a in axes):
        raise CommandError(f"every axis must be a number in [-1, 1], got {axes!r}")
    return Command(seq=seq, t_ms=float(t), env=env, axes=tuple(float(a) for a in axes))


class RateLimiter:
    """Token bucket: ``rate_hz`` on average, bursts up to ``burst``."""

    def __init__(self, rate_hz: float, burst: float | None = None) -> None:
        self.rate = rate_hz
        self.burst = burst if burst is not None else max(1.0, rate_hz / 4)
        self.tokens = self.burst
        self.last: float | None = None
        self.dropped = 0

    def allow(self, now: float) -> bool:
        if self.last is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.dropped += 1
        return False


class StaleFilter:
    """Drops commands that arrive out of order or late.

    Page and server clocks need not agree: the smallest ``arrival - t`` seen so far
    is taken as the clock offset plus the fastest delivery, and a command whose
    delay exceeds it by more than ``max_age_s`` is stale."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_ms = max_age_s * 1000.0
        self.offset_ms: float | None = None
        self.last_seq = -1
        self.dropped = 0

    def accept(self, cmd: Command, now_ms: float) -> bool:
        if cmd.seq <= self.last_seq:
            self.dropped += 1
            return False
        delay = now_ms - cmd.t_ms
        if self.offset_ms is None or delay < self.offset_ms:
            self.offset_ms = delay
        if delay - self.offset_ms > self.max_age_ms:
            self.dropped += 1
            return False
        self.last_seq = cmd.seq
        return True


class Deadman:
    """The last command holds for ``timeout_s`` after it arrived, until :meth:`hold`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last: float | None = None
        self.reason = "no command yet"

    def feed(self, now: float) -> None:
        self.last = now

    def hold(self, reason: str) -> None:
        self.last, self.reason = None, reason

    def alive(self, now: float) -> bool:
        if self.last is not None and now - self.last > self.timeout_s:
            self.hold(f"no command for {self.timeout_s:g} s")
        return self.last is not None


@dataclass
class TeleopSettings:
    deadman_s: float = 0.5
    stale_command_s: float = 0.3
    max_command_hz: float = 60.0
    scale: float = 0.5
    step_timeout_s: float = 5.0
    release_ramp_s: float = 0.5


@dataclass
class TeleopState:
    """What the page shows about the takeover; a snapshot, copied under the loop's lock."""

    active: bool = False
    worker: str | None = None
    env: int = 0
    holding: str | None = "no command yet"
    steps: int = 0
    action: list[float] = field(default_factory=list)
    joint_pos: list[float] = field(default_factory=list)
    dropped_rate: int = 0
    dropped_stale: int = 0
    ended: str | None = None


class ActionShaper:
    """Axes in [-1, 1] -> one env's action, holding the robot's current command otherwise."""

    def __init__(
        self, low: np.ndarray, high: np.ndarray, *, scale: float, dt: float, command_key: str | None = None
    ) -> None:
        self.low, self.high = np.asarray(low, np.float64), np.asarray(high, np.float64)
        self.scale, self.dt = scale, dt
        self.command_key = command_key
        """Absolute action space: the observation holding the current command (None: deltas)."""
        self.targets: np.ndarray | None = None
        """Absolute: the commands being held, per env [K, A] (from the first observation)."""

    @property
    def absolute(self) -> bool:
        return self.command_key is not None

    def observe(self, obs: dict[str, np.ndarray], num_envs: int) -> None:
        """Take the robot's current commands from ``obs`` (absolute action spaces): at the
        takeover, and for the envs not being driven, after every step."""
        if self.command_key is None:
            return
        current = obs.get(self.command_key)
        if current is None:
            raise ValueError(f"observation has no {self.command_key!r} (the spec's command_key)")
        current = np.asarray(current, np.float64).reshape(num_envs, -1)
        if current.shape[1] != len(self.low):
            raise ValueError(
                f"observation {self.command_key!r} has {current.shape[1]} values per env, the action {len(self.low)}"
            )
        self.targets = np.clip(current, self.low, self.high)

    def action(self, num_envs: int, env: int, axes: np.ndarray | None) -> np.ndarray:
        """The action for every env: ``axes`` (None: hold) applied to ``env``."""
        if self.command_key is None:
            out = np.zeros((num_envs, len(self.low)))
            if axes is not None:
                bound = np.where(axes >= 0, self.high, -self.low)
                out[env] = np.clip(axes * bound * self.scale, self.low, self.high)
            return out
        if self.targets is None:
            raise ValueError("absolute action space: no observation of the current command yet")
        held: np.ndarray = self.targets.copy()
        if axes is not None:
            rate = (self.high - self.low) / 2 * self.scale
            held[env] = np.clip(held[env] + axes * rate * self.dt, self.low, self.high)
            self.targets[env] = held[env]
        return held


def ramp_action(held: np.ndarray, policy: np.ndarray, a: float) -> np.ndarray:
    """One env's action ``a`` of the way from the held command to the policy's (``a`` in [0, 1])."""
    a = min(1.0, max(0.0, a))
    return (1.0 - a) * np.asarray(held, np.float64) + a * np.asarray(policy, np.float64)


class TeleopLoop:
    """One takeover of one worker through the gateway's client socket, in its own thread."""

    def __init__(
        self,
        address: str,
        *,
        worker: str,
        settings: TeleopSettings,
        current_obs: Callable[[], dict[str, np.ndarray]] | None = None,
        others: Any = None,
    ) -> None:
        """``current_obs()``: the worker's newest observation (its tap), which an absolute
        action space needs before the first action (the current command to hold) and
        ``others`` before its first answer. ``others``: the experiment's action source
        (:class:`gateway.policies.ActionSource`) acting for the envs the operator does
        not drive (None: they hold); the loop closes it."""
        from gateway.client import GatewayVectorEnv

        self.settings = settings
        self.current_obs = current_obs
        self.others = others
        # Held requests (e-stop, pause) are not waited out: the loop lets go instead, so
        # that a Resume never hands motion back to a takeover nobody holds any more.
        self.env = GatewayVectorEnv(
            address, worker=worker, takeover=True, timeout_s=settings.step_timeout_s, hold_timeout_s=1.0
        )
        try:
            self._setup()
        except BaseException:
            self.env.close()
            if others is not None:
                others.close()
            raise
        self.state = TeleopState(active=True, worker=worker)
        self._thread = threading.Thread(target=self._run, name="teleop", daemon=True)

    def _setup(self) -> None:
        spec = self.env.spec_
        self.num_envs = self.env.num_envs
        self.action_size = int(np.prod(spec.action.shape))
        self.dt = 1.0 / spec.control_hz
        self.dtype = np.dtype(spec.action.dtype)
        self.high = np.broadcast_to(np.asarray(spec.action.high, dtype=np.float64), (self.action_size,))
        self.low = np.broadcast_to(np.asarray(spec.action.low, dtype=np.float64), (self.action_size,))
        metadata = spec.metadata or {}
        absolute = metadata.get("action_space") == "absolute"
        command_key = metadata.get("command_key") if absolute else None
        if absolute and not isinstance(command_key, str):
            raise ValueError(
                "the spec declares an absolute action space but no command_key (the observation holding the "
                "current command): teleoperation could not start without a jump"
            )
        self.shaper = ActionShaper(
            self.low, self.high, scale=self.settings.scale, dt=self.dt, command_key=command_key
        )
        if self.shaper.absolute:  # bumpless: start from what the robot is commanded now
            if self.current_obs is None:
                raise ValueError("an absolute action space needs the worker's current observation to start")
            self.shaper.observe(self.current_obs(), self.num_envs)
        self.limiter = RateLimiter(self.settings.max_command_hz)
        self.stale = StaleFilter(self.settings.stale_command_s)
        self.deadman = Deadman(self.settings.deadman_s)
        self._lock = threading.Lock()
        self._axes = np.zeros(self.action_size)
        self._stop = threading.Event()
        self._ramp = threading.Event()
        """Set by :meth:`release` with a ramp: hand the driven env back to the policy, then stop."""
        self._asked = 0

    def start(self) -> None:
        self._thread.start()

    def command(self, cmd: Command, now: float, now_ms: float) -> bool:
        """Take ``cmd`` if it passes the rate limit and is fresh; False when dropped."""
        if self._ramp.is_set():  # released: the env is being handed back to the policy
            return False
        with self._lock:
            if not self.limiter.allow(now) or not self.stale.accept(cmd, now_ms):
                self.state.dropped_rate, self.state.dropped_stale = self.limiter.dropped, self.stale.dropped
                return False
            self._axes = np.asarray(cmd.axes)
            self.state.env = cmd.env
            self.deadman.feed(now)
            return True

    def hold(self, reason: str) -> None:
        with self._lock:
            self.deadman.hold(reason)
        if self._ramp.is_set():  # no motion fades in over a hold: let go at once, holding
            self._stop.set()

    @property
    def ramp_steps(self) -> int:
        """Steps of a release's ramp (0: there is none: no policy for the env, or no ramp set)."""
        if self.others is None or self.settings.release_ramp_s <= 0:
            return 0
        return max(1, math.ceil(self.settings.release_ramp_s / self.dt - 1e-9))

    def release(self, *, ramp: bool = False) -> None:
        """Stop; with ``ramp``, first hand the driven env back to the policy over
        ``release_ramp_s`` (see the module docstring). Returns once the loop has ended."""
        if ramp and self.ramp_steps and self._thread.is_alive():
            self._ramp.set()
            wait_s = self.ramp_steps * (self.dt + POLICY_WAIT_S) + self.settings.step_timeout_s
        else:
            self._stop.set()
            wait_s = 0.0
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=wait_s + self.settings.step_timeout_s + 2.0)
            if self._thread.is_alive():  # the ramp did not finish in time: let go now
                self._stop.set()
                self._thread.join(timeout=self.settings.step_timeout_s + 2.0)

    def snapshot(self) -> TeleopState:
        with self._lock:
            return TeleopState(**vars(self.state))

    def _hold_for_ramp(self) -> None:
        """During a release's ramp the operator's keys no longer count: the env holds."""
        with self._lock:
            self.deadman.hold("released")

    def _action(self, now: float) -> tuple[np.ndarray, int, str | None]:
        """Every env's action, the env the operator drives and why it holds (None: it
        does not), read together: a command may switch envs at any moment."""
        with self._lock:
            alive = self.deadman.alive(now)
            env = self.state.env
            action = self.shaper.action(self.num_envs, env, self._axes if alive else None)
        return action.astype(self.dtype), env, None if alive else self.deadman.reason

    def _policy_actions(self, obs: dict[str, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray] | None:
        """The experiment's actions and versions for ``obs`` (every env), or None (no
        source, no observation yet, or no answer within ``POLICY_WAIT_S``: those envs hold)."""
        if self.others is None or obs is None:
            return None
        self._asked += 1
        key = ("console", self._asked)
        self.others.submit(key, obs, time.monotonic() + POLICY_WAIT_S)
        deadline = time.monotonic() + POLICY_WAIT_S
        while True:
            for got, actions, versions, error in self.others.results():
                if got == key and error is None and actions is not None and versions is not None:
                    return np.asarray(actions), np.asarray(versions, np.int64)
                if got == key:
                    log.warning("the policy gave no actions for the envs not driven: %s", error)
                    return None
            if self.others.synchronous or time.monotonic() > deadline or self._stop.is_set():
                return None
            self.others.tick()
            self._stop.wait(0.001)

    def _run(self) -> None:
        ended = "released"
        obs: dict[str, np.ndarray] | None = None
        try:
            if self.others is not None and self.current_obs is not None:
                try:
                    obs = self.current_obs()
                except LookupError:  # no tap: the other envs hold until the first step's answer
                    obs = None
            next_tick = time.monotonic()
            ramped = 0
            while not self._stop.is_set():
                ramping = self._ramp.is_set()
                if ramping:
                    self._hold_for_ramp()
                action, env, holding = self._action(time.monotonic())
                driven = np.zeros(self.num_envs, bool)
                driven[env] = True  # the operator's env: its steps are interventions
                self.env.intervention = driven
                theirs = self._policy_actions(obs)
                if theirs is not None:  # the policy keeps driving the envs the operator does not
                    if ramping:
                        action[env] = ramp_action(action[env], theirs[0][env], (ramped + 1) / self.ramp_steps)
                    action = np.where(driven.reshape(-1, *[1] * (action.ndim - 1)), action, theirs[0])
                    self.env.policy_version = np.where(driven, 0, theirs[1])
                if ramping:
                    holding = f"handing back to the policy ({ramped + 1}/{self.ramp_steps})"
                try:
                    obs, *_ = self.env.step(action.astype(self.dtype))
                except RemoteError as exc:
                    if exc.code != "unexpected":  # the worker's next observation is not in yet
                        raise
                    self._stop.wait(self.dt / 4)
                    continue
                with self._lock:  # what the page sees: the step just taken, all of it
                    self.state.steps += 1
                    self.state.holding = holding
                    self.state.action = [round(float(a), 4) for a in action[env].ravel()]
                    joints = obs.get("joint_pos")
                    if joints is not None:
                        self.state.joint_pos = [round(float(j), 4) for j in joints[env]]
                ramped += ramping  # a step taken: the ramp moves on
                if ramping and ramped >= self.ramp_steps:
                    ended = "released to the policy"
                    break
                next_tick += self.dt
                self._stop.wait(max(0.0, next_tick - time.monotonic()))
                next_tick = max(next_tick, time.monotonic() - self.dt)
        except RunEnded:
            ended = "the run ended"
        except Timeout as exc:  # Held is a Timeout: e-stop or pause while in control
            reason = getattr(exc, "reason", None)
            ended = f"held by the gateway ({reason})" if reason else f"the gateway did not answer: {exc}"
        except RemoteError as exc:
            ended = f"the gateway refused: {exc}"
        finally:
            self.env.close()
            if self.others is not None:
                self.others.close()
            with self._lock:
                self.state.active, self.state.ended, self.state.holding = False, ended, ended
            log.info("teleoperation of %s ended: %s", self.state.worker, ended)
