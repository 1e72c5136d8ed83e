"""The training loop: replay batches in, updates, versioned weights out.

Every rank samples its share of each batch from the replay service (several requests
in flight, so sampling overlaps compute), converts it to tensors (pinned, non-blocking
copies on CUDA) and takes an update; FSDP averages the gradients. Every
``publish_every`` updates a new policy version goes to the inference servers
(:mod:`trainer.publish`), every ``checkpoint_every`` a checkpoint is saved
(:mod:`trainer.checkpoint`), and every ``eval_every`` the gateway is asked for
evaluation episodes. Execution modes (``trainer.mode``):

- ``async`` / ``disaggregated``: collection never waits for training; the gateway pauses
  while the served policy is more than ``max_policy_lag`` versions behind;
- ``sync``: rounds of ``collect_steps`` env steps (the gateway's step budget is raised
  round by round), then ``updates_per_round`` updates, then a publication.

Stops at ``max_updates``, when the run's step budget is spent, when a periodic
evaluation reaches ``target_success_rate``, or on SIGTERM; always with a checkpoint.
Rank 0 decides and the decision is broadcast, so every rank stops at the same update.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gateway.config import ExperimentConfig
from gateway.endpoints import EndpointsFollower, lookup
from gateway.episode import EnvSpec
from gateway.gpu_stats import for_device
from gateway.metrics import MetricsWriter
from gateway.protocol import RemoteError, Timeout
from trainer import checkpoint
from trainer.algos import Algorithm, OnPolicyAlgorithm, make_algorithm
from trainer.distributed import World, from_rank0
from trainer.publish import LaggedControl, Publisher, full_state_dict
from trainer.versions import PUBLISHED, last_published

log = logging.getLogger(__name__)

STOPPING_TIMEOUT_S = 2.0
"""Longest wait for a peer (a request, a sample slice) once a signal asked the trainer to
stop: the supervisor stops the run, and a peer may already be gone (every service gets
its SIGTERM at once when ``loopgate up`` itself died), so the usual timeouts would keep
the ranks past torchrun's own shutdown limit."""
UNTRAINED_EVAL_HOLD_S = 120.0
"""Longest the trainer holds back publication for the untrained policy's evaluation round."""


@dataclass
class Counters:
    updates: int = 0
    version: int = 0
    samples: int = 0
    skipped: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    def saved(self) -> dict[str, int]:
        return {"updates": self.updates, "version": self.version, "samples": self.samples}


class Trainer:
    def __init__(self, cfg: ExperimentConfig, run_dir: Path, endpoints: dict[str, Any], world: World) -> None:
        self.cfg, self.tc, self.run_dir, self.world = cfg, cfg.trainer, run_dir, world
        self.endpoints = endpoints
        self.spec = EnvSpec.from_dict(json.loads((run_dir / "spec.json").read_text()))
        torch.set_num_threads(self.tc.threads)
        torch.manual_seed(self.tc.seed + world.rank)
        net = cfg.inference.network
        self.algo: Algorithm = make_algorithm(
            self.tc.algorithm, self.spec, net, dict(self.tc.options), device=world.device
        )
        if world.size > 1:  # every rank starts from rank 0's initial weights
            for module in self.algo.modules().values():
                for p in module.parameters():
                    dist.broadcast(p.data, src=0)
        self.algo.shard(world)
        self.algo.build_optimizers()
        self.ckpt_dir = run_dir / "checkpoints"
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.c = Counters()
        latest = checkpoint.latest(self.ckpt_dir)
        if latest is not None:
            saved = checkpoint.load(self.algo, latest)
            self.c.updates, self.c.version, self.c.samples = (
                saved["updates"],
                saved["version"],
                saved["samples"],
            )
        from trainer.replay.client import ReplayClient

        self.replay = ReplayClient(
            endpoints["replay"]["sample"], prefetch=self.tc.prefetch, interrupted=self._take_signal
        )
        self.follower = EndpointsFollower(run_dir / "endpoints.json")
        """The run's addresses, followed: a peer restarted on another node is dialled there."""
        self.control: Any = None
        self.publisher: Publisher | None = None
        if world.is_main:
            from gateway.control_client import ControlClient

            self.control = ControlClient(endpoints["gateway"]["control"])
            targets = endpoints.get("inference", []) if cfg.inference.enabled else []
            self.publisher = Publisher(
                spec=self.spec,
                net_config=net,
                targets=targets,
                onnx=cfg.inference.backend == "onnxruntime",
                control=LaggedControl(endpoints["gateway"]["control"], self.tc),
                record=self.ckpt_dir / PUBLISHED,
                # One trainer process on a GPU: snapshots stay there for CUDA IPC.
                device=world.device.type == "cuda"
                and world.size == 1
                and cfg.inference.backend == "torch"
                and cfg.inference.cuda_ipc != "off",
            )
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl" if world.is_main else None, "trainer")
        self.gpu = for_device(str(world.device)) if world.is_main else None
        self.stop_requested = False
        self.signalled = False
        """A SIGTERM or SIGINT asked it to stop: nothing more is waited for."""
        self._signal_unseen = False
        """A signal came that no wait for replay data has ended for yet (:meth:`_take_signal`)."""
        self._last_batch: dict[str, torch.Tensor] = {}
        self._replay_gone: dict[str, torch.Tensor] | None = None
        """The last batch, repeated once a stopping trainer found the replay service gone."""
        self.stop_reason = ""
        self._last_eval_round = 0
        self._start = (time.monotonic(), 0, 0.0, 0.0, 0)
        self._eval_history: list[float] = []
        self._budget_reached = False
        self._probe: Any = None
        """The line to the gateway a rank waiting for data asks whether collection is over."""
        self._held_round: int | None = None
        """Rank 0: the untrained policy's evaluation round, while publication waits for it."""
        self._held_since = 0.0
        self._hold_over = False
        """Every rank: the hold ended (it never starts again), so no collective asks any more."""

    # ------------------------------------------------------------------ pieces

    def on_signal(self, signum: int) -> None:
        """SIGTERM or SIGINT: stop at the next check; a wait for replay data ends now."""
        self.signalled = True
        self._signal_unseen = True
        if self.publisher is not None:
            self.publisher.shorten_waits(STOPPING_TIMEOUT_S)
        self.request_stop(f"signal {signum}")

    def _take_signal(self) -> bool:
        """Once per signal: whether a wait for replay data should end now. The stop path of
        :meth:`batch` then takes over (release the rate limits, sample on with short waits)."""
        seen, self._signal_unseen = self._signal_unseen, False
        return seen

    def peer_timeout_s(self, usual: float) -> float:
        """``usual``, or :data:`STOPPING_TIMEOUT_S` at most once a signal asked for a stop."""
        return min(usual, STOPPING_TIMEOUT_S) if self.signalled else usual

    def batch(self) -> dict[str, torch.Tensor]:
        from trainer.replay.client import ReplayUnavailable, SampleTimeout

        if self._replay_gone is not None:
            return self._replay_gone
        per_rank = self.tc.batch_size // self.world.size
        started = time.monotonic()
        warned, released = 0.0, False
        try:
            while True:
                self.follow_endpoints()
                try:
                    # Short slices, so that a wait for data that will never come is noticed.
                    slice_s = self.peer_timeout_s(min(self.tc.sample_timeout_s, 5.0))
                    arrays = self.replay.sample(per_rank, tables=dict(self.tc.tables), timeout_s=slice_s)
                    break
                except (SampleTimeout, ReplayUnavailable) as exc:
                    if time.monotonic() - warned >= 30.0:
                        log.info(
                            "waiting for replay data (%.0f s so far): %s", time.monotonic() - started, exc
                        )
                        warned = time.monotonic()
                    if self.stop_requested or self.collection_over():
                        if not released:
                            # No more steps will come, or none are waited for: the ratio must not
                            # hold back what is there. A rank that stopped here alone would leave
                            # the others in the update's collectives; with the tables released,
                            # every rank samples on to the next stop check they take together.
                            answered = self.release_replay(any_rank=True)
                            released = True
                            if answered or not self.signalled:
                                continue
                        if self.signalled and isinstance(exc, ReplayUnavailable) and self._last_batch:
                            # The replay service is gone (the whole run is stopping), while other
                            # ranks may hold a batch and be inside the update's collectives: this
                            # rank repeats its last batch until the stop check they take together.
                            log.info(
                                "the replay service is gone; repeating the last batch until the ranks stop"
                            )
                            self._replay_gone = self._last_batch
                            return self._replay_gone
                        # Every rank sees the same tables, too small to sample, and stops here.
                        self.request_stop(
                            f"the run's env step budget is spent and the replay tables cannot serve a batch ({exc})"
                        )
                        raise
        finally:
            # Every wait counts, the one that ends in a stop too: a trainer that never got a
            # batch waited for data all of its time.
            self.c.wait_s += time.monotonic() - started
        pin = self.world.device.type == "cuda"
        out = {}
        for k, v in arrays.items():
            if not isinstance(v, np.ndarray) or v.dtype.kind not in "biuf":
                continue
            t = torch.from_numpy(np.ascontiguousarray(v))
            out[k] = t.pin_memory().to(self.world.device, non_blocking=True) if pin else t
        self._last_batch = out
        return out

    def follow_endpoints(self) -> None:
        """Re-point this rank's sockets at peers that moved (``endpoints.json`` changed: the
        Ray engine restarted one on another node): the replay service on every rank; the
        gateway and the inference servers on rank 0."""
        endpoints = self.follower.poll()
        if endpoints is None:
            return
        self.endpoints = endpoints
        sample = lookup(endpoints, "replay", "sample")
        if sample is not None:
            self.replay.repoint(sample)
        control = lookup(endpoints, "gateway", "control")
        if control is not None:
            for client in (self.control, self._probe, getattr(self.publisher, "control", None)):
                target = getattr(client, "client", client)  # the publisher's line wraps one
                if target is not None and target.address != control:
                    log.warning("gateway moved: %s -> %s", target.address, control)
                    target.address = control
        if self.publisher is not None and self.cfg.inference.enabled:
            self.publisher.retarget(endpoints.get("inference") or [])

    def publish(self) -> None:
        self.c.version += 1
        # A collective: every rank takes part; rank 0 copies into a spare snapshot.
        if self.publisher is not None:
            self.publisher.submit(self.c.version, self.publisher.snapshot(self.algo.actor))
        else:
            full_state_dict(self.algo.actor)

    def publication_held(self) -> bool:
        """Whether the untrained policy's evaluation still runs: until it ends, the first
        version keeps acting, so the learning curve's first point is the untrained policy
        however slowly the evaluation episodes come round. Training goes on meanwhile (and
        keeps collection flowing through the replay rate limiter). Rank 0 decides; a
        collective like the publication it gates, until the hold is over."""
        if self._hold_over:
            return False
        self._hold_over = not from_rank0(self.world, self._held_round is not None)
        return not self._hold_over

    def await_untrained_round(self) -> None:
        """Before the last publication: a run that ends (its update or step budget) while
        the untrained policy's evaluation still runs lets that round end first, so that none
        of its episodes act with the trained weights (up to ``UNTRAINED_EVAL_HOLD_S`` from
        its start). A signal ends the wait at once."""
        logged = False
        while True:
            if self.world.is_main and self.signalled:
                self._held_round = None
            if not self.publication_held():
                return
            if self.world.is_main:
                if not logged:
                    log.info(
                        "waiting for the untrained policy's evaluation round to end before the last publication"
                    )
                    logged = True
                self.poll_gateway()
            time.sleep(0.2)

    def evaluate_if_due(self) -> None:
        if self.control is None or not self.tc.eval_every or self.c.updates % self.tc.eval_every:
            return
        if self.signalled:
            return  # the run is stopping: no new round (the gateway may be gone already)
        try:
            self.control.request("evaluate", timeout_s=5.0, episodes=self.tc.eval_episodes)
        except (Timeout, RemoteError) as exc:
            log.warning("could not start an evaluation: %s", exc)

    def poll_gateway(self) -> None:
        """Rank 0: stop when the step budget is spent or an evaluation hit its target."""
        if self.control is None:
            return
        try:
            status = self.control.request("status", timeout_s=self.peer_timeout_s(5.0))
        except (Timeout, RemoteError):
            return
        self._budget_reached = bool(status.get("budget_reached"))
        last = (status.get("eval") or {}).get("last")
        if self._held_round is not None:
            if last and last["round"] >= self._held_round:
                self._held_round = None
            elif time.monotonic() - self._held_since > UNTRAINED_EVAL_HOLD_S:
                log.warning(
                    "the untrained policy's evaluation did not finish in %.0f s; publishing anyway",
                    UNTRAINED_EVAL_HOLD_S,
                )
                self._held_round = None
        if last and last["round"] != self._last_eval_round:
            self._last_eval_round = last["round"]
            self.metrics.emit({"eval": last, "updates": self.c.updates, "env_steps": status.get("env_steps")})
            success = last["success_rate"]
            log.info(
                "evaluation round %d: success %s, return %.2f (version %d)",
                last["round"],
                "n/a (the env reports no success)" if success is None else f"{success:.2f}",
                last["return_mean"],
                last["policy_version"],
            )
            target = self.tc.target_success_rate
            if success is not None:
                self._eval_history.append(success)
            recent = self._eval_history[-self.tc.target_rounds :]
            # One lucky round of a few episodes is not a policy that reaches reliably.
            if target is not None and len(recent) == self.tc.target_rounds and min(recent) >= target:
                self.request_stop(
                    f"{self.tc.target_rounds} evaluation round(s) in a row reached success rate {target:.2f}"
                )
        if self._budget_reached and self.tc.mode != "sync":
            self.request_stop("the run's env step budget is spent")

    def request_stop(self, why: str) -> None:
        if not self.stop_requested:
            self.stop_requested, self.stop_reason = True, why

    def should_stop(self) -> bool:
        """Rank 0's decision, shared with every rank."""
        if self.tc.max_updates is not None and self.c.updates >= self.tc.max_updates:
            self.request_stop(f"{self.c.updates} updates done")
        if self.world.size == 1:
            return self.stop_requested
        if self.c.updates % 10 and self.tc.mode != "sync":
            return False  # a collective per update is measurable on CPU; ten updates late is fine
        return bool(from_rank0(self.world, self.stop_requested))

    def update(self) -> None:
        batch = self.batch()
        t0 = time.monotonic()
        stats = self.algo.update(batch)
        self.c.compute_s += time.monotonic() - t0
        self.c.updates += 1
        self.c.samples += self.tc.batch_size
        self.c.skipped += int(stats.get("skipped", 0))
        if stats.get("skipped"):
            log.warning("update %d skipped: non-finite loss or gradients", self.c.updates)
        self.c.stats = stats
        if self.c.updates % self.tc.publish_every == 0 and not self.publication_held():
            self.publish()
        if self.c.updates % self.tc.checkpoint_every == 0:
            checkpoint.save(self.algo, self.ckpt_dir, self.c.saved(), is_main=self.world.is_main)
        self.evaluate_if_due()

    # -------------------------------------------------------------------- loop

    def resume_version(self) -> None:
        """Never publish a version older than one already out (after a restart from a
        checkpoint older than the last publication): continue after the newest of the
        run's record of publications and the gateway's view."""
        seen = max(self.c.version, last_published(self.ckpt_dir / PUBLISHED))
        if self.control is not None:
            try:
                status = self.control.request("status", timeout_s=10.0)
                seen = max(
                    seen,
                    int(status.get("trainer_version", 0)),
                    int(status.get("policy_version", 0)),
                )
            except (Timeout, RemoteError) as exc:
                log.warning("could not ask the gateway for published versions: %s", exc)
        seen = int(from_rank0(self.world, seen))
        if seen > self.c.version:
            log.info("continuing after version %d (published before the restart)", seen)
            self.c.version = seen

    def run(self) -> int:
        self.resume_version()
        self.publish()  # the servers act with the trainer's weights from the start
        if self.c.updates == 0 and self.tc.eval_every and self.control is not None:
            # The untrained policy's score: the first point of the learning curve.
            started = self.control.request("evaluate", timeout_s=5.0, episodes=self.tc.eval_episodes)
            if started.get("started"):
                self._held_round, self._held_since = int(started["round"]), time.monotonic()
        last_report = time.monotonic()
        self._start = (time.monotonic(), self.c.updates, self.c.wait_s, self.c.compute_s, self.c.samples)
        try:
            while not self.should_stop():
                if self.tc.mode == "sync":
                    self.sync_round()
                else:
                    self.update()
                now = time.monotonic()
                if now - last_report >= 1.0:
                    if not self.signalled:  # stopping: asked once more after the loop
                        self.poll_gateway()
                    self.report()
                    last_report = now
        except (Timeout, RemoteError) as exc:
            if not self.stop_requested:
                raise
            log.info("stopping while waiting for data (%s)", exc)
        log.info("trainer stopping: %s", self.stop_reason or "asked to")
        self.await_untrained_round()
        self.poll_gateway()  # an evaluation round that ended since the last look is recorded too
        self.publish()
        checkpoint.save(self.algo, self.ckpt_dir, self.c.saved(), is_main=self.world.is_main)
        self.report()
        self.release_replay()
        return 0

    def report(self) -> None:
        """One metrics record: counters, rates since the start, the last update's statistics."""
        started, start_updates, start_wait, start_compute, start_samples = self._start
        elapsed = max(time.monotonic() - started, 1e-9)
        busy = self.c.wait_s - start_wait + self.c.compute_s - start_compute
        done = self.c.updates - start_updates
        self.metrics.emit(
            {
                "updates": self.c.updates,
                "version": self.c.version,
                "samples": self.c.samples,
                "updates_per_s": round(done / elapsed, 2),
                "samples_per_s": round((self.c.samples - start_samples) / elapsed, 1),
                "data_wait_frac": round((self.c.wait_s - start_wait) / busy, 3) if busy else 0.0,
                "skipped_updates": self.c.skipped,
                **self.c.stats,
                "publications_refused": self.publisher.refused if self.publisher else 0,
                **({"gpu": self.gpu.snapshot()} if self.gpu is not None else {}),
            }
        )

    def collection_over(self) -> bool:
        """Any rank, while it waits for data: the gateway will record no more steps (its
        budget is spent outside sync mode, where the trainer raises it, or it drains)."""
        from gateway.control_client import ControlClient

        gateway = self.endpoints.get("gateway", {}).get("control")
        if gateway is None:
            return False
        if self._probe is None:  # rank 0's own control client, or one of this rank's
            self._probe = self.control or ControlClient(gateway)
        try:
            status = self._probe.request("status", timeout_s=5.0)
        except (Timeout, RemoteError):
            return False
        budget_spent = bool(status.get("budget_reached")) and self.tc.mode != "sync"
        return budget_spent or bool(status.get("draining"))

    def release_replay(self, any_rank: bool = False) -> bool:
        """Nothing samples any more: collection (the final evaluation) must not wait for the
        replay tables' update-to-data ratio. Whether the replay service answered."""
        if not (self.world.is_main or any_rank):
            return True
        from gateway.control_client import ControlClient

        client = ControlClient(self.endpoints["replay"]["control"])
        try:
            client.request("release_rate_limits", timeout_s=self.peer_timeout_s(10.0))
            return True
        except (Timeout, RemoteError) as exc:
            log.warning("could not release the replay rate limits: %s", exc)
            return False
        finally:
            client.close()

    def sync_round(self) -> None:
        """Wait for this round's ``collect_steps``, take ``updates_per_round`` updates,
        publish, then open the next round (the gateway starts with the first round's
        budget, so collection never runs ahead of training)."""
        if self.control is not None:
            while not self.stop_requested:
                status = self.control.request("status", timeout_s=5.0)
                if status.get("budget_reached"):
                    break
                time.sleep(0.05)
        if self.should_stop():
            return
        if isinstance(self.algo, OnPolicyAlgorithm):
            self.on_policy_round(self.algo)
        else:
            for _ in range(self.tc.updates_per_round):
                self.update()
            if not self.publication_held():
                self.publish()
        if self.control is not None:
            status = self.control.request("status", timeout_s=5.0)
            target = int(status["env_steps"]) + self.tc.collect_steps
            budget = self.cfg.run.max_env_steps
            if budget is not None and int(status["env_steps"]) >= budget:
                self.request_stop("the run's env step budget is spent")
                return
            if budget is not None:
                target = min(target, budget)
            self.control.request("set_budget", timeout_s=5.0, max_env_steps=target)

    def on_policy_round(self, algo: OnPolicyAlgorithm) -> None:
        """Train on the round's steps of the version the parameters are, then publish the next.

        Publication waits for the untrained policy's evaluation before training starts:
        training first would leave the next round acting with a version whose parameters
        the trainer no longer holds."""
        while True:  # both collectives, in the same order on every rank
            if self.should_stop():
                return  # a stop (SIGTERM) does not wait for the hold to end
            if not self.publication_held():
                break
            if self.world.is_main:
                self.poll_gateway()
            time.sleep(0.2)
        from trainer.rollout import fetch_rollout

        t0 = time.monotonic()
        rollout, info = fetch_rollout(self, self.c.version)
        self.c.wait_s += time.monotonic() - t0
        self.c.stats = {f"rollout/{k}": float(v) for k, v in info.items()}
        if info["kept"] < algo.min_rollout():
            log.info(
                "round of version %d: %d step(s) of it stored, %d needed (%d older dropped); collecting again",
                self.c.version,
                info["kept"],
                algo.min_rollout(),
                info["stale"],
            )
            self.confirm_version()
            return
        t0 = time.monotonic()
        before = self.c.updates
        stats = algo.learn(rollout)
        self.c.compute_s += time.monotonic() - t0
        self.c.updates += int(stats.pop("updates"))
        self.c.skipped += int(stats.pop("skipped_updates", 0))
        self.c.samples += int(info["kept"]) * getattr(algo.config, "epochs", 1)
        self.c.stats.update(stats)
        log.info(
            "version %d: %d steps (%d older dropped), %d updates",
            self.c.version,
            info["kept"],
            info["stale"],
            self.c.updates - before,
        )
        self.publish()
        self.confirm_version()
        every = self.tc.checkpoint_every
        if self.c.updates // every != before // every:
            checkpoint.save(self.algo, self.ckpt_dir, self.c.saved(), is_main=self.world.is_main)
        due = self.tc.eval_every and self.c.updates // self.tc.eval_every != before // self.tc.eval_every
        if due and self.control is not None:
            try:
                self.control.request("evaluate", timeout_s=5.0, episodes=self.tc.eval_episodes)
            except (Timeout, RemoteError) as exc:
                log.warning("could not start an evaluation: %s", exc)

    def confirm_version(self, deadline_s: float = 10.0) -> None:
        """Rank 0: wait until the gateway acts with the trainer's version, so the next
        round's first steps do not act with an older one (those would be dropped)."""
        if self.control is None or self.publisher is None or not self.cfg.inference.enabled:
            return
        self.publisher.flush()
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and not self.stop_requested:
            try:
                if (
                    int(self.control.request("status", timeout_s=5.0).get("policy_version", 0))
                    >= self.c.version
                ):
                    return
            except (Timeout, RemoteError):
                pass
            time.sleep(0.02)
        log.warning("the gateway does not act with version %d after %.0f s", self.c.version, deadline_s)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.flush()
            self.publisher.close()
        self.replay.close()
        if self.control is not None:
            self.control.close()
        if self._probe is not None and self._probe is not self.control:
            self._probe.close()
        self.metrics.close()
