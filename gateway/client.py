"""Drive a running gateway from your own script, as a Gymnasium env.

The gateway attaches the client to one env worker; resets and steps go to that worker's
envs, and every step is recorded like any other (run with ``policy.kind: external`` so
the experiment's policy leaves the workers to clients)::

    from gateway.client import GatewayEnv, GatewayVectorEnv

    env = GatewayEnv("tcp://127.0.0.1:5556")          # a worker with num_envs == 1
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())

    venv = GatewayVectorEnv("tcp://127.0.0.1:5556", num_envs=8)   # autoreset: same-step
    obs, info = venv.reset(seed=0)

The address is the gateway's ``clients`` endpoint (``endpoints.json`` of the run), or
the run folder itself (or its ``endpoints.json``), read when ``loopgate up`` has written
it: ``GatewayEnv("runs/my-run")``.
Every call has a deadline (``timeout_s``) and raises :class:`~gateway.protocol.Timeout`
instead of hanging; errors from the gateway arrive as
:class:`~gateway.protocol.RemoteError`.

A script may start with ``loopgate up``: until a worker has registered with the gateway,
the constructor waits (held, reason ``no_worker``); with workers registered, one that
none of them can take (another ``num_envs``, all attached) raises at once.

The gateway's stop states apply to scripts as to its own policy. While the e-stop is
engaged, collection is paused, the step budget is reached or the replay service pushes
back, ``reset`` and ``step`` wait: the gateway says so about once a second (the reason
is logged and in :attr:`GatewayEnv.held`), and the call returns once the state lifts
(or raises :class:`Held` after ``hold_timeout_s``, if given). When the run ends, calls
raise :class:`~gateway.protocol.RunEnded`::

    try:
        while True:
            obs, reward, terminated, truncated, info = env.step(policy(obs))
    except RunEnded:
        pass    # budget spent or run stopped: every acknowledged step is stored
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import zmq
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from gateway.endpoints import lookup
from gateway.endpoints import read as read_endpoints
from gateway.episode import EnvSpec
from gateway.protocol import Message, MsgType, RunEnded, Timeout, raise_for_error, recv, send, unpack
from gateway.steps import StepInfo
from gateway.transport import CurveKeys, connect, make_socket

__all__ = ["GatewayEnv", "GatewayVectorEnv", "Held", "RunEnded"]

log = logging.getLogger(__name__)

HELD_LOG_S = 30.0
"""A call held that long is logged again (with the reason) so a long wait is never silent."""


class Held(Timeout):
    """A call was held by the gateway (pause, e-stop, budget, backpressure) for longer than
    ``hold_timeout_s``; ``reason`` says which."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"held by the gateway ({reason}): {message}")
        self.reason = reason


class _Connection:
    """One attachment of a client to a worker through the gateway."""

    def __init__(
        self,
        address: str | os.PathLike[str],
        num_envs: int | None,
        *,
        worker: str | None,
        takeover: bool,
        timeout_s: float,
        keys: CurveKeys | None,
        version: int,
        hold_timeout_s: float | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.hold_timeout_s = hold_timeout_s
        self.held: str | None = None
        """Why the gateway holds the call in progress (None: it does not)."""
        address = clients_address(address, timeout_s)
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self.sock = make_socket(self._ctx, zmq.DEALER)
        connect(self.sock, address, keys)
        self._seq = 0
        meta = {
            "role": "client",
            "num_envs": num_envs,
            "worker": worker,
            "takeover": takeover,
            "version": version,
        }
        welcome = self.call(Message(MsgType.HELLO, meta=meta))
        self.worker: str = welcome.meta["worker"]
        self.num_envs: int = int(welcome.meta["num_envs"])
        self.spec = EnvSpec.from_dict(welcome.meta["spec"])

    def call(self, msg: Message) -> Message:
        self._seq += 1
        msg.seq = self._seq
        send(self.sock, msg)
        deadline = time.monotonic() + self.timeout_s
        held_since = logged = 0.0
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.sock.poll(int(remaining * 1000)):
                    raise Timeout(f"{msg.type.name}: no answer from the gateway within {self.timeout_s} s")
                reply = recv(self.sock)
                if reply.seq != self._seq:  # anything older answers a call that timed out
                    continue
                if reply.type is not MsgType.HELD:
                    return raise_for_error(reply)
                # The gateway is alive and holds the call: wait on, with a fresh deadline.
                now = time.monotonic()
                reason, text = str(reply.meta.get("reason")), str(reply.meta.get("message", ""))
                if reason != self.held or now - logged >= HELD_LOG_S:
                    log.info("%s held by the gateway (%s): %s", msg.type.name, reason, text)
                    logged = now
                held_since = held_since or now
                self.held = reason
                if self.hold_timeout_s is not None and now - held_since > self.hold_timeout_s:
                    raise Held(reason, text)
                deadline = now + self.timeout_s
        finally:
            self.held = None

    def close(self) -> None:
        if not self.sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                send(self.sock, Message(MsgType.BYE), flags=zmq.NOBLOCK)
            self.sock.close(linger=100)


def clients_address(address: str | os.PathLike[str], timeout_s: float) -> str:
    """The gateway's clients endpoint for ``address``: a ZeroMQ address as it is, else a
    run folder or its ``endpoints.json``, waited for up to ``timeout_s`` (a script may
    start before ``loopgate up`` has written it). :class:`Timeout` saying what was looked for."""
    text = os.fspath(address)
    if "://" in text:
        return text
    path = Path(text)
    path = path if path.name == "endpoints.json" else path / "endpoints.json"
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        found = lookup(read_endpoints(path), "gateway", "clients")
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            raise Timeout(
                f"{path} names no gateway within {timeout_s:g} s: is `loopgate up` running on "
                f"{path.parent}? (or give the gateway's address, tcp://HOST:PORT)"
            )
        if not said:
            log.info("waiting up to %g s for %s (loopgate up writes it as it starts)", timeout_s, path)
            said = True
        time.sleep(0.1)


def _action_batch(action: Any, spec: EnvSpec, num_envs: int) -> np.ndarray:
    """``action`` as the batch a STEP carries: ``num_envs`` actions of the spec's dtype and
    shape, given as that batch or flat. ``ValueError`` saying what was expected otherwise
    (the gateway checks the values: NaN, a discrete action's range)."""
    want = (num_envs, *spec.action.shape)
    try:
        batch = np.asarray(action, dtype=spec.action.dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"action {action!r} is not {spec.action.dtype}: {exc}") from None
    if batch.size != int(np.prod(want)):
        raise ValueError(
            f"action has shape {list(batch.shape)}, expected {list(want)} "
            f"({num_envs} env(s), each {spec.action.dtype}{list(spec.action.shape)})"
        )
    return batch.reshape(want)


def _row(obs: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    return {k: np.array(v[i]) for k, v in obs.items()}


class GatewayEnv(gym.Env[dict[str, np.ndarray], np.ndarray]):
    """One env of a gateway worker (``num_envs == 1``) as a ``gymnasium.Env``."""

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        worker: str | None = None,
        takeover: bool = False,
        timeout_s: float = 10.0,
        keys: CurveKeys | None = None,
        version: int = 0,
        hold_timeout_s: float | None = None,
    ) -> None:
        self._conn = _Connection(
            address,
            1,
            worker=worker,
            takeover=takeover,
            timeout_s=timeout_s,
            keys=keys,
            version=version,
            hold_timeout_s=hold_timeout_s,
        )
        self.spec_ = self._conn.spec
        self.observation_space = self.spec_.observation_space()
        self.action_space = self.spec_.action_space()
        self.metadata = {"render_modes": [], "render_fps": self.spec_.control_hz}
        self._next_obs: dict[str, np.ndarray] | None = None

    @property
    def worker(self) -> str:
        return self._conn.worker

    @property
    def held(self) -> str | None:
        """Why the gateway holds the call in progress, from another thread (None: it does not)."""
        return self._conn.held

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        if seed is None and options is None and self._next_obs is not None:
            # The worker reset this env already when its last episode ended.
            obs, self._next_obs = self._next_obs, None
            return obs, {}
        reply = self._conn.call(Message(MsgType.RESET, meta={"seed": seed, "options": options}))
        self._next_obs = None
        return _row(unpack("obs", reply.arrays), 0), {}

    def step(self, action: Any) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        batch = _action_batch(action, self.spec_, 1)
        reply = self._conn.call(Message(MsgType.STEP, arrays={"action": batch}))
        a = reply.arrays
        result = StepInfo(a["step_info"])
        obs = _row(unpack("obs", a), 0)
        terminated, truncated = bool(result.terminated[0]), bool(result.truncated[0])
        info = {"success": bool(result.success[0])}
        if terminated or truncated:
            self._next_obs = obs
            final = unpack("final_obs", a)
            obs = _row(final, 0) if final else obs
        return obs, float(result.reward[0]), terminated, truncated, info

    def close(self) -> None:
        self._conn.close()
        super().close()


class GatewayVectorEnv(VectorEnv[dict[str, np.ndarray], np.ndarray, np.ndarray]):
    """All envs of a gateway worker as a ``gymnasium.vector.VectorEnv`` (same-step autoreset)."""

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        num_envs: int | None = None,
        worker: str | None = None,
        takeover: bool = False,
        timeout_s: float = 10.0,
        keys: CurveKeys | None = None,
        version: int = 0,
        hold_timeout_s: float | None = None,
    ) -> None:
        self._conn = _Connection(
            address,
            num_envs,
            worker=worker,
            takeover=takeover,
            timeout_s=timeout_s,
            keys=keys,
            version=version,
            hold_timeout_s=hold_timeout_s,
        )
        self.num_envs = self._conn.num_envs
        spec = self._conn.spec
        self.spec_ = spec
        self.single_observation_space = spec.observation_space()
        self.single_action_space = spec.action_space()
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_fps": spec.control_hz}
        self.intervention: np.ndarray | None = None
        """Which envs a person drives (bool per env), sent with each step; None: the
        gateway's default (every env of a ``takeover`` client is an intervention)."""
        self.policy_version: np.ndarray | None = None
        """Version of the weights behind each env's action (i64 per env), sent with each
        step; None: the ``version`` given at attach time for every env."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        reply = self._conn.call(Message(MsgType.RESET, meta={"seed": seed, "options": options}))
        return {k: np.array(v) for k, v in unpack("obs", reply.arrays).items()}, {}

    def step(
        self, actions: Any
    ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        batch = _action_batch(actions, self.spec_, self.num_envs)
        meta = {"intervention": [bool(v) for v in self.intervention]} if self.intervention is not None else {}
        arrays = {"action": batch}
        if self.policy_version is not None:
            arrays["policy_version"] = np.asarray(self.policy_version, np.int64)
        reply = self._conn.call(Message(MsgType.STEP, meta=meta, arrays=arrays))
        a = reply.arrays
        obs = {k: np.array(v) for k, v in unpack("obs", a).items()}
        result = StepInfo(a["step_info"])
        terminated, truncated = result.terminated, result.truncated
        info: dict[str, Any] = {"success": result.success}
        done = terminated | truncated
        final = unpack("final_obs", a)
        if final and done.any():
            # Gymnasium's same-step convention: final_obs per env, masked by _final_obs.
            final_obs = np.empty(self.num_envs, dtype=object)
            for i in range(self.num_envs):
                final_obs[i] = _row(final, i) if done[i] else None
            info["final_obs"], info["_final_obs"] = final_obs, done
        return obs, result.reward, terminated, truncated, info

    @property
    def held(self) -> str | None:
        """Why the gateway holds the call in progress, from another thread (None: it does not)."""
        return self._conn.held

    def close_extras(self, **kwargs: Any) -> None:
        self._conn.close()
