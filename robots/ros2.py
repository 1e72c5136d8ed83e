"""The ``ros2`` backend: real robots over ROS 2 behind the episode interface.

One backend drives ``num_envs`` robots, one per ROS namespace, in lock step (batched
like every backend). Each robot is described by a topic map (:mod:`robots.topic_map`);
the task's rules (:class:`sim_bridges.reach.ReachTask`: targets, reward, success) run on
the robot's observations exactly as in the simulator, so the spec equals the MuJoCo
backend's and the same policy drives both::

    backend = make_backend("ros2", num_envs=1, seed=0, options={"topic_map": "reach_arm"})
    obs, info = backend.reset(seed=0)     # moves home, waits until settled
    obs, reward, terminated, truncated, info = backend.step(action)   # one control period

A step: the action (joint position target deltas in units of ``max_delta``) becomes
absolute targets, is clamped by :class:`robots.safety.CommandLimits` and published;
then the step waits for the next tick of the control loop (``clock: backend``: this
process's clock; ``clock: robot``: the joint state due next) and reads one message per
topic, aligned by header stamp (:func:`robots.sources.align`). ``info`` marks steps
whose observation was ``stale`` (older than ``max_age_s``) or ``misaligned`` (stamps
further apart than ``max_skew_s``), and carries ``obs_age_s``, ``skew_s``, ``clamped``
and ``estopped`` per robot.

Safety does not depend on the policy or the gateway: the e-stop topic and a watchdog
(holding the robot when actions stop for ``safety.watchdog_timeout_s``) are served by
their own node on their own executor thread; a hold is published the moment the e-stop
message arrives. The gateway's e-stop (:meth:`estop`) takes the same path. Finished
episodes reset in the same step (the routine in ``env.options.reset``), which on a
robot takes seconds: the backend calls the worker's ``keepalive`` meanwhile so the
gateway keeps hearing from the worker and its commands (e-stop, ``ready``) get through.

A robot that falls silent for ``lost_timeout_s`` raises :class:`RobotDisconnected`: the
worker exits, the gateway closes its episodes as interrupted (steps kept), and the
restarted worker waits up to ``connect_timeout_s`` for the robot to return.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.episode import AutoresetMode, EnvSpec, EpisodeBackend, Info, Obs, StepResult
from robots.ros2_config import ResetConfig, Ros2Config
from robots.safety import CommandLimits, EstopLatch, Watchdog
from robots.sources import align, image_array
from sim_bridges.reach import IMAGE_KEY

log = logging.getLogger(__name__)

__all__ = ["ResetConfig", "RobotDisconnected", "RobotUnavailable", "Ros2Backend", "Ros2Config"]


class RobotUnavailable(RuntimeError):
    """A robot did not publish within ``connect_timeout_s`` of start-up."""


class RobotDisconnected(RuntimeError):
    """A robot stopped publishing joint states for ``lost_timeout_s``."""


class Ros2Backend(EpisodeBackend):
    """Robots over ROS 2 (see the module docstring)."""

    Config = Ros2Config
    autoreset_mode = AutoresetMode.SAME_STEP

    @classmethod
    def spec_for(cls, config: Ros2Config) -> EnvSpec:
        """The spec, without connecting to anything."""
        return config.spec()

    def __init__(self, config: Ros2Config | None = None, *, num_envs: int, seed: int = 0) -> None:
        config = config or Ros2Config()
        if num_envs != len(config.namespaces):
            raise ValueError(
                f"env.num_envs is {num_envs} but env.options.namespaces lists {len(config.namespaces)} "
                f"robot(s) {list(config.namespaces)}: give one namespace per robot"
            )
        from robots.link import LoopStats, RobotLink
        from robots.ros_io import RosSession

        self.config = config
        self.num_envs = num_envs
        self.spec = config.spec()
        self.task = config.task()
        self.map = config.map
        self.period = 1.0 / config.control_hz
        self.rngs = [np.random.default_rng(seed + i) for i in range(num_envs)]
        joints = len(self.map.joints)
        self._ctrl = np.zeros((num_envs, joints))
        """Last position command per robot (actions move it, as in the simulator)."""
        self._targets = np.zeros((num_envs, 2))
        self._steps = np.zeros(num_envs, dtype=np.int64)
        self._ready = np.zeros(num_envs, dtype=bool)
        self._velocity = self.map.action.interface == "velocity"
        self._keys = config.observation_keys()
        self._lock = threading.RLock()
        """Held while a command is computed and published: steps, holds and e-stops never interleave."""
        self._in_reset = False
        self._closed = False
        self._next_tick = 0.0
        self._new_run = True
        """The next tick starts a new run of steps (after a reset): no jitter or overrun for its gap."""
        self.latch = EstopLatch()
        self.watchdog = Watchdog(config.safety.watchdog_timeout_s)
        self.limits = CommandLimits(
            config.safety,
            self.task.joint_low,
            self.task.joint_high,
            control_hz=config.control_hz,
            what="ros2",
        )
        self.stats = LoopStats(self.period)
        self.session = RosSession(config.node_name, domain_id=config.domain_id, executor=config.executor)
        try:
            node = self._node = self.session.node(config.node_name)
            safety = self.session.node(f"{config.node_name}_safety")
            sources = [s for s in self.map.observations if set(s.keys) & set(self._keys)]
            if self.map.primary not in sources:
                sources.insert(0, self.map.primary)
            self.robots = [RobotLink(node, self.map, ns, sources, config.history) for ns in config.namespaces]
            if self.map.estop is not None:
                from std_msgs.msg import Bool

                from robots.ros_io import qos_profile

                safety.create_subscription(
                    Bool, self.map.estop.topic, self._on_estop_topic, qos_profile(self.map.estop.qos)
                )
            safety.create_timer(min(config.safety.watchdog_timeout_s / 4, 0.02), self._on_watchdog_timer)
            self.session.start()
            self._wait_for_robots()
        except BaseException:
            self.close()
            raise
        for i, robot in enumerate(self.robots):
            self._ctrl[i] = robot.latest("joint_pos")

    # ----------------------------------------------------------------- start-up

    def _wait_for_robots(self) -> None:
        start = time.monotonic()
        deadline = start + self.config.connect_timeout_s
        next_log = start + 5.0
        while True:
            self._raise_robot_errors()
            missing = [t for r in self.robots for t in r.missing()]
            if not missing:
                log.info(
                    "%d robot(s) up after %.1f s: %s",
                    self.num_envs,
                    time.monotonic() - start,
                    self.config.namespaces,
                )
                return
            now = time.monotonic()
            if now > deadline:
                raise RobotUnavailable(
                    f"no messages on {missing} within {self.config.connect_timeout_s:.0f} s "
                    f"(is the robot up, in ROS domain {self._domain()}?)"
                )
            if now > next_log:
                log.info("waiting for the robot: nothing yet on %s", missing)
                next_log = now + 5.0
            time.sleep(0.02)

    def _domain(self) -> str:
        return str(
            self.config.domain_id if self.config.domain_id is not None else os.environ.get("ROS_DOMAIN_ID", 0)
        )

    def _raise_robot_errors(self) -> None:
        self.session.check()
        for robot in self.robots:
            if robot.error is not None:
                raise robot.error

    # ------------------------------------------------------------------ safety

    def _on_estop_topic(self, msg: Any) -> None:
        self._set_estop("topic", bool(msg.data))

    def estop(self, engaged: bool) -> None:
        """The gateway's e-stop: the same hold as the topic's."""
        self._set_estop("gateway", engaged)

    def _set_estop(self, source: str, engaged: bool) -> None:
        with self._lock:
            changed = self.latch.set(source, engaged)
            self.estopped = self.latch.engaged
            if engaged and not self._closed:
                self._hold(range(self.num_envs))
            if changed:
                log.warning("e-stop %s by %s", "ENGAGED" if engaged else "released", source)
            if not self.latch.engaged:
                self.watchdog.pause()

    def _on_watchdog_timer(self) -> None:
        with self._lock:
            if self._in_reset or self.latch.engaged or self._closed:
                return
            if self.watchdog.expired(time.monotonic()):
                log.warning(
                    "watchdog: no action for %.2f s; holding every robot (trip %d)",
                    self.config.safety.watchdog_timeout_s,
                    self.watchdog.trips,
                )
                self._hold(range(self.num_envs))

    def _hold(self, envs: Any) -> None:
        """Command every robot in ``envs`` to stay where it is (caller holds the lock)."""
        for i in envs:
            robot = self.robots[i]
            if robot.histories[robot.primary].latest() is None:
                continue  # nothing heard from it yet: it has received no command to hold either
            here = np.clip(robot.latest("joint_pos").astype(float), self.limits.low, self.limits.high)
            self._ctrl[i] = here
            robot.publish(np.zeros_like(here) if self._velocity else here, self.period)

    def _command(self, action: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
        """Publish the commands for ``action``; which robots had a command clamped."""
        with self._lock:
            if self.watchdog.feed(time.monotonic()):
                log.info("actions resumed after a watchdog hold")
            if self.latch.engaged:
                self.stats.add("refused_estop", self.num_envs)
                return np.zeros(self.num_envs, dtype=bool)
            clipped = np.minimum(np.maximum(action, -1.0), 1.0)
            action_hit = (clipped != action).any(axis=-1)
            if action_hit.any():
                self.limits.counts.add("action", int(action_hit.sum()), " (action outside [-1, 1])")
            target = self.task.apply_action(self._ctrl, clipped)
            command, hit = self.limits.position(target, self._ctrl)
            out = command
            if self._velocity:
                here = np.stack([r.latest("joint_pos") for r in self.robots]).astype(float)
                out, vhit = self.limits.velocity((command - here) / self.period, here)
                hit |= vhit
            for robot, values in zip(self.robots, out):
                robot.publish(values, self.period)
            self._ctrl = command
            clamped: npt.NDArray[np.bool_] = hit | action_hit
            return clamped

    # ---------------------------------------------------------------- observing

    def _wait_tick(self) -> None:
        """Wait for the control loop's next tick (see ``clock``), then count how late it came."""
        if self.config.clock == "robot":
            interval = max(r.state_interval() for r in self.robots)
            earliest = self._next_tick - min(0.5 * interval, 0.5 * self.period)
            deadline = self._next_tick + self.config.max_age_s
            # The state arrives on this thread (no hand-over from the executor's); a step
            # that comes late finds it there and does not borrow the node at all.
            waiting = [r for r in self.robots if not r.wait_for_primary(earliest, 0.0)]
            if waiting:
                with self.session.borrow(self._node) as spin:
                    for robot in waiting:
                        robot.wait_for_primary(earliest, deadline, spin)
        else:
            delay = self._next_tick - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        tick = time.monotonic()
        late = tick - self._next_tick > self.period
        if late and not self._new_run:
            self.stats.add("overruns")
        if self.config.clock == "robot":
            # Phase-locked to the robot: the next tick is due a period after this state arrived.
            self._next_tick = max(r.histories[r.primary].latest_received() for r in self.robots) + self.period
        else:
            # A late tick does not make the next ones come faster to catch up.
            self._next_tick = tick + self.period if late else self._next_tick + self.period
        self.stats.tick(tick, new_run=self._new_run)
        self._new_run = False

    def _observe(self) -> tuple[Obs, Info]:
        self._raise_robot_errors()
        now, wall = time.monotonic(), time.time()
        n = self.num_envs
        values: dict[str, list[Any]] = {k: [] for k in self._keys}
        age = np.zeros(n, dtype=np.float32)
        skew = np.zeros(n, dtype=np.float32)
        for i, robot in enumerate(self.robots):
            silent = robot.silent_for(now)
            if silent > self.config.lost_timeout_s:
                raise RobotDisconnected(
                    f"robot {robot.namespace!r}: no message on {robot.topics[robot.primary]} for {silent:.1f} s "
                    f"(lost_timeout_s {self.config.lost_timeout_s}); its episode ends here"
                )
            if len(robot.histories) == 1:  # nothing to align: the newest message
                chosen = [robot.histories[0].newest()]
            else:
                chosen, skew[i] = align([h.snapshot() for h in robot.histories])
            age[i] = wall - min(e.stamp for e in chosen)
            merged = {k: v for e in chosen for k, v in e.values.items()}
            for key in self._keys:
                values[key].append(merged[key])
        obs = self.task.observe(np.array(values["joint_pos"]), np.array(values["joint_vel"]), self._targets)
        for key in self._keys:
            if key == IMAGE_KEY:
                shape = (self.config.image_height, self.config.image_width)
                obs[key] = np.stack(
                    [
                        image_array(raw, shape, f"robot {r.namespace!r}")
                        for raw, r in zip(values[key], self.robots)
                    ]
                )
            elif key not in obs:
                obs[key] = np.array(values[key], dtype=self.spec.observation[key].dtype)
        stale = age > self.config.max_age_s
        misaligned = skew > self.config.max_skew_s
        self.stats.add("stale", int(stale.sum()))
        self.stats.add("misaligned", int(misaligned.sum()))
        info: Info = {"stale": stale, "misaligned": misaligned, "obs_age_s": age, "skew_s": skew}
        return obs, info

    # -------------------------------------------------------------- episodes

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Obs, Info]:
        if options:
            raise ValueError(f"ros2 takes no reset options, got {sorted(options)}")
        self._live()
        if seed is not None:
            self.rngs = [np.random.default_rng(seed + i) for i in range(self.num_envs)]
        self._reset_envs(np.arange(self.num_envs))
        obs, info = self._observe()
        _, success, _, distance = self.task.outcome(obs)
        info.update(
            success=success,
            distance=distance,
            clamped=np.zeros(self.num_envs, bool),
            estopped=self._estop_flags(),
        )
        return obs, info

    def step(self, action: npt.NDArray[Any]) -> StepResult:
        self._live()
        action = np.asarray(action)
        problems = self.spec.check_action(action, self.num_envs)
        if problems:
            raise ValueError(f"ros2: {'; '.join(problems)}")
        self._raise_robot_errors()
        clamped = self._command(action)
        self._wait_tick()
        obs, info = self._observe()
        self._steps += 1
        self.stats.add("steps")
        reward, success, terminated, distance = self.task.outcome(obs)
        truncated = self._steps >= self.config.max_episode_steps
        info.update(success=success, distance=distance, clamped=clamped, estopped=self._estop_flags())
        done = terminated | truncated
        if done.any():
            finished = np.flatnonzero(done)
            info["final_obs"] = obs
            self._reset_envs(finished)
            fresh, _ = self._observe()
            obs = {key: value.copy() for key, value in obs.items()}
            for key, value in fresh.items():
                obs[key][finished] = value[finished]
        self.stats.maybe_log("ros2 control loop", self.counters)
        return obs, np.asarray(reward, dtype=np.float32), terminated, truncated, info

    def _estop_flags(self) -> npt.NDArray[np.bool_]:
        return np.full(self.num_envs, self.latch.engaged)

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError("ros2 backend is closed")

    # ------------------------------------------------------------ reset routine

    def _reset_envs(self, envs: npt.NDArray[np.intp]) -> None:
        """Run the reset routine for ``envs``; every other robot holds meanwhile."""
        with self._lock:
            self._in_reset = True
            self._hold([i for i in range(self.num_envs) if i not in set(envs.tolist())])
        try:
            starts, targets = zip(*(self.task.sample_initial(self.rngs[i]) for i in envs))
            if self.config.reset.move_home:
                self._move_home(envs, np.stack(starts))
            if self.config.reset.wait_for_operator:
                self._await_operator(envs)
            for i, target in zip(envs, targets):
                self._targets[i] = target
                self.robots[i].publish_target(target)
            self._steps[envs] = 0
        finally:
            with self._lock:
                self._in_reset = False
                self.watchdog.pause()
            self._next_tick = time.monotonic() + self.period
            self._new_run = True

    def _keepalive(self) -> bool:
        """Let the host serve its peers while a reset blocks; False when it is stopping."""
        self._raise_robot_errors()
        return self.keepalive() if self.keepalive is not None else True

    def _measured(
        self, envs: npt.NDArray[np.intp]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        now = time.monotonic()
        for i in envs:
            if self.robots[i].silent_for(now) > self.config.lost_timeout_s:
                raise RobotDisconnected(f"robot {self.robots[i].namespace!r} went silent during its reset")
        q = np.stack([self.robots[i].latest("joint_pos") for i in envs]).astype(float)
        qd = np.stack([self.robots[i].latest("joint_vel") for i in envs]).astype(float)
        return q, qd

    def _move_home(self, envs: npt.NDArray[np.intp], goal: npt.NDArray[np.float64]) -> None:
        """Along a joint-space line at ``reset.speed``, then wait until settled."""
        cfg = self.config.reset
        # No faster than the step limit allows, so homing never trips a clamp.
        speed = min(cfg.speed, self.limits.max_change * self.config.control_hz)
        inside = np.clip(goal, self.limits.low, self.limits.high)
        if not np.array_equal(inside, goal):
            self.stats.add("start_outside_limits")
            log.warning(
                "reset: start posture outside safety.position limits; starting at the nearest allowed one"
            )
            goal = inside
        start = self._ctrl[envs].copy()  # the step limit counts from the last command
        ticks = max(1, int(np.ceil(np.abs(goal - start).max() / speed / self.period)))
        k = 0
        deadline = None
        while True:
            if not self._keepalive():
                return
            if self.latch.engaged:  # the e-stop holds the robot; the move waits for its release
                time.sleep(self.period)
                continue
            with self._lock:
                if self.latch.engaged:
                    continue
                k += 1
                waypoint = start + (goal - start) * min(1.0, k / ticks)
                command, _ = self.limits.position(waypoint, self._ctrl[envs])
                q, qd = self._measured(envs)
                for j, i in enumerate(envs):
                    out = command[j]
                    if self._velocity:
                        out = np.clip((command[j] - q[j]) * 5.0, -speed, speed)
                    self.robots[i].publish(out, self.period)
                self._ctrl[envs] = command
            if k >= ticks:
                deadline = deadline or time.monotonic() + cfg.settle_timeout_s
                settled = np.all(np.abs(q - goal) < cfg.settle_tolerance) and np.all(
                    np.abs(qd) < cfg.settle_velocity
                )
                if settled and np.allclose(self._ctrl[envs], goal):
                    break
                if time.monotonic() > deadline:
                    self.stats.add("settle_timeouts")
                    log.warning(
                        "reset: robot(s) %s not settled after %.1f s; starting anyway",
                        envs.tolist(),
                        cfg.settle_timeout_s,
                    )
                    break
            time.sleep(self.period)
        if self._velocity:
            with self._lock:
                self._hold(envs)

    def _await_operator(self, envs: npt.NDArray[np.intp]) -> None:
        cfg = self.config.reset
        with self._lock:
            self._ready[envs] = False
        names = [self.robots[i].namespace for i in envs]
        log.warning("robot(s) %s home: waiting for the operator's ready (gateway command `ready`)", names)
        start = time.monotonic()
        next_log = start + 30.0
        while not self._ready[envs].all():
            if not self._keepalive():
                return
            now = time.monotonic()
            if cfg.operator_timeout_s is not None and now - start > cfg.operator_timeout_s:
                self.stats.add("operator_timeouts")
                log.warning(
                    "no ready for robot(s) %s within %.0f s; starting anyway", names, cfg.operator_timeout_s
                )
                return
            if now > next_log:
                log.warning("still waiting for the operator's ready for robot(s) %s", names)
                next_log = now + 30.0
            time.sleep(0.02)
        log.info("operator ready: robot(s) %s start", names)

    def command(self, name: str, meta: Mapping[str, Any]) -> bool:
        """``ready`` (optionally ``{"env": i}``): the operator lets waiting robots start."""
        if name != "ready":
            return False
        env = meta.get("env")
        with self._lock:
            if env is None:
                self._ready[:] = True
            elif isinstance(env, int) and 0 <= env < self.num_envs:
                self._ready[env] = True
            else:
                log.warning("ready for env %r ignored: this backend has envs 0..%d", env, self.num_envs - 1)
                return False
        return True

    # ---------------------------------------------------------------- lifetime

    def counters(self) -> dict[str, Any]:
        """Clamps, watchdog trips, e-stops and loop statistics."""
        return {
            **self.stats.summary(),
            "clamps": dict(self.limits.counts.counts),
            "watchdog_trips": self.watchdog.trips,
            "estops": self.latch.engagements,
            "commands": sum(r.commands for r in getattr(self, "robots", [])),
        }

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            if getattr(self, "robots", None) and self.session.context.ok():
                try:
                    self._hold(range(self.num_envs))  # a velocity-controlled robot must not keep going
                except RuntimeError as exc:
                    log.warning("could not command a final hold: %s", exc)
        self.session.close()
        log.info("ros2 backend closed: %s", self.counters())
        if self.config.stats_file:
            Path(self.config.stats_file).write_text(json.dumps(self.counters(), indent=2))
