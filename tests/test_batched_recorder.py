"""The recorder's batch path (a worker's whole batch as columns) against its per-episode path.

Both paths must store exactly the same chunks (ids, boundaries, arrays, ends), recover
from each other's spool, deduplicate re-sent steps and lose nothing across a restart.
Real recorder, real spool, real episode store on disk.
"""

from __future__ import annotations

import numpy as np
import pytest

from gateway.env_columns import EpisodeIds, split_episode_id
from gateway.recorder import Recorder
from gateway.store import EpisodeStore, StoreSink
from gateway.trajectory import Transitions, episode_id
from tests.test_recorder import SilentSink, settle

pytestmark = pytest.mark.unit

N = 6
CHUNK = 4


class Envs:
    """``N`` envs with ragged episode lengths, as a batched simulator steps them."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.length = self.rng.integers(3, 11, N)
        self.step = self.rng.integers(0, 3, N)
        self.episode = np.zeros(N, np.int64)

    def batch(self, lazy: bool, worker: str = "w1") -> tuple[Transitions, np.ndarray]:
        n, s = N, self.step
        envs = np.arange(n)
        done = s + 1 >= self.length[envs]
        columns = dict(
            reward=(-s).astype(np.float32),
            terminated=done & (envs % 2 == 0),
            truncated=done & (envs % 2 == 1),
            success=np.zeros(n, bool),
            policy_version=np.full(n, 3, np.int64),
            t_capture=s * 0.5,
            t_action=s * 0.5 + 0.1,
            step=s.astype(np.int64),
        )
        ids: object = (
            EpisodeIds(worker, envs, self.episode)
            if lazy
            else [episode_id(worker, e, int(k)) for e, k in zip(envs, self.episode)]
        )
        obs = {"q": (envs[:, None] * 100 + s[:, None] + np.zeros((n, 3))).astype(np.float32)}
        steps = Transitions(ids, envs, obs, np.tile(s[:, None], (1, 2)).astype(np.float32), columns)  # type: ignore[arg-type]
        return steps, done

    def advance(self, done: np.ndarray) -> None:
        self.step += 1
        self.episode[done] += 1
        self.step[done] = 0


def make(tmp, sink_cls=StoreSink, **kw) -> Recorder:
    return Recorder(tmp / "spool", sink_cls(EpisodeStore(tmp / "episodes")), chunk_steps=CHUNK, **kw)


def run_steps(rec: Recorder, envs: Envs, steps: int, lazy: bool) -> None:
    for _ in range(steps):
        batch, done = envs.batch(lazy)
        flags = (envs.episode % 3 == 1).tolist()  # some episodes are evaluation episodes
        rec.record(batch, worker="w1", task="reach", eval_flags=flags if any(flags) else None)
        ended = np.flatnonzero(done)
        reasons = ["terminated" if batch.columns["terminated"][e] else "truncated" for e in ended]
        final = {"q": np.full((len(ended), 3), -1.0, np.float32)}
        if lazy:
            rec.end_many("w1", ended, envs.episode[ended], reasons, final)
        else:
            for j, e in enumerate(ended.tolist()):
                rec.end(batch.episodes[e], reasons[j], {"q": final["q"][j]})
        rec.pump()
        envs.advance(done)


def stored(tmp) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for ep in EpisodeStore(tmp / "episodes", readonly=True).episodes():
        out[ep.episode_id] = {"end": ep.end, **{k: np.asarray(v).tolist() for k, v in ep.arrays.items()}}
    return out


def test_a_batch_is_stored_exactly_as_the_per_episode_path_stores_it(tmp_path):
    for lazy in (False, True):
        rec = make(tmp_path / str(lazy))
        run_steps(rec, Envs(), 40, lazy)
        rec.drain()
        settle(rec)
        rec.close()
    per_episode, batched = stored(tmp_path / "False"), stored(tmp_path / "True")
    assert per_episode and batched == per_episode
    evals = {
        name: {
            c.meta["episode_id"]
            for c in EpisodeStore(tmp_path / name / "episodes", readonly=True).chunks()
            if c.meta["eval"]
        }
        for name in ("False", "True")
    }
    assert evals["True"] and evals["True"] == evals["False"]
    chunks = EpisodeStore(tmp_path / "True" / "episodes", readonly=True).count()
    assert chunks.duplicate_steps == 0 and chunks.completed_episodes > N


def test_a_batch_cuts_chunks_on_the_same_step_boundaries(tmp_path):
    rec = make(tmp_path)
    run_steps(rec, Envs(), 25, lazy=True)
    rec.drain()
    settle(rec)
    for ep in EpisodeStore(tmp_path / "episodes", readonly=True).episodes():
        steps = np.asarray(ep.arrays["step"])
        np.testing.assert_array_equal(steps, np.arange(steps[0], steps[0] + len(steps)))
    store = EpisodeStore(tmp_path / "episodes", readonly=True)
    for chunk in store.chunks():
        first, n = chunk.meta["first_step"], chunk.meta["num_steps"]
        assert first // CHUNK == (first + n - 1) // CHUNK, chunk.meta["chunk_id"]


def test_resent_batch_steps_are_acknowledged_once(tmp_path):
    rec = make(tmp_path)
    envs = Envs()
    batch, done = envs.batch(lazy=True)
    assert rec.record(batch, worker="w1", task="reach") == N
    assert rec.record(batch, worker="w1", task="reach") == 0
    assert rec.counters.duplicate_resends == N
    ended = np.flatnonzero(done)
    rec.end_many("w1", ended, envs.episode[ended], ["truncated"] * len(ended))
    assert rec.record(batch, worker="w1", task="reach") == 0  # closed episodes too
    assert rec.open_episodes() == N - len(ended)


def test_a_restart_recovers_a_batched_spool_and_the_worker_resumes_without_loss(tmp_path):
    rec = make(tmp_path, SilentSink)
    envs = Envs()
    run_steps(rec, envs, 17, lazy=True)
    before = rec.counters.acked_steps
    rec.sink.close()  # killed: nothing acknowledged by the sink, the recorder not closed
    again = make(tmp_path)
    summary = again.recover()
    assert summary["acked_steps"] == before
    # The worker resends the step it last sent (prev/*), then goes on.
    last = Envs()
    run_steps(make(tmp_path / "scratch"), last, 16, lazy=True)
    resent, _ = last.batch(lazy=True)
    assert again.record(resent, worker="w1", task="reach") == 0
    run_steps(again, envs, 9, lazy=True)
    assert again.open_episodes() > 0 and not again.open  # adopted by the worker's table
    again.drain()
    settle(again)
    count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
    assert count.duplicate_steps == 0 and count.stored_steps == N * 26


def test_an_interrupted_batched_worker_keeps_every_step(tmp_path):
    rec = make(tmp_path)
    run_steps(rec, Envs(), 7, lazy=True)
    assert rec.undelivered_steps() > 0
    still_open = rec.open_episodes()  # envs whose episode ended on the last step have none open
    assert 0 < still_open <= N
    assert rec.interrupt("w1") == still_open and rec.open_episodes() == 0
    settle(rec)
    assert rec.undelivered_steps() == 0
    count = EpisodeStore(tmp_path / "episodes", readonly=True).count()
    assert count.stored_steps == N * 7 and count.interrupted_episodes == still_open


def test_episode_ids_are_made_on_demand_and_split_back():
    ids = EpisodeIds("host-12-ab", np.array([0, 7]), np.array([3, 0]))
    assert list(ids) == ["host-12-ab-0-3", "host-12-ab-7-0"] and ids[1] == "host-12-ab-7-0"
    assert split_episode_id(ids[0]) == ("host-12-ab", 0, 3)
    assert split_episode_id("nonsense") is None
    with pytest.raises(ValueError, match="differ in shape"):
        EpisodeIds("w", np.arange(3), np.arange(2))


def test_a_newer_episode_in_an_env_closes_the_open_one_as_interrupted(tmp_path):
    rec = make(tmp_path)
    envs = Envs()
    envs.length[:] = 100  # nothing ends by itself
    run_steps(rec, envs, 3, lazy=True)
    envs.episode[0] += 1  # env 0 moved on without its episode ending (a lost end)
    envs.step[0] = 0
    run_steps(rec, envs, 2, lazy=True)
    assert rec.counters.episodes_interrupted == 1 and rec.open_episodes() == N
    rec.drain()
    settle(rec)
    episodes = {ep.episode_id: ep for ep in EpisodeStore(tmp_path / "episodes", readonly=True).episodes()}
    assert episodes["w1-0-0"].end == "interrupted" and episodes["w1-0-0"].num_steps == 3
    assert episodes["w1-0-1"].num_steps == 2


def test_a_histogram_fed_a_batch_at_once_equals_one_fed_value_by_value():
    from gateway.metrics import Histogram

    values = np.concatenate([[0.0, 0.0, 1e-12, 0.5, 1.0], np.random.default_rng(0).lognormal(3, 2, 5000)])
    one, batch = Histogram(), Histogram()
    for v in values.tolist():
        one.add(v)
    batch.add_array(values)
    batch.add_array(np.zeros(0))
    assert batch.counts == one.counts and batch.n == one.n and batch.max == one.max
    assert batch.total == pytest.approx(one.total)
    assert batch.percentile(50) == one.percentile(50) and batch.percentile(99) == one.percentile(99)
    # The buckets are those records of earlier runs were counted in (two-argument log),
    # at bucket boundaries too: histograms merge across versions exactly.
    import math

    edges = [1.04**k for k in range(-600, 600)] + [math.nextafter(1.04**k, 0) for k in range(-600, 600)]
    for v in [*values.tolist(), *edges, 1e-9, 2e-9, 5e-10]:
        assert one._bucket(v) == (int(math.log(max(v, 1e-9), 1.04)) if v > 0 else -10_000), v


def test_the_policy_lag_of_a_batch_is_each_steps_lag():
    from gateway.evaluation import LagTracker

    lag = LagTracker()
    lag.report(3, made_at=100.0, max_lag=None)
    lag.report(4, made_at=110.0, max_lag=None)
    lag.report(5, made_at=120.0, max_lag=None)
    versions = np.array([5, 4, 4, 3, 5, 2])
    t_action = np.array([125.0, 115.0, 130.0, 105.0, 126.0, 101.0])
    lag.observe(versions, t_action)
    # Versions behind: 0 1 1 2 0 3. Seconds acted after the next version was made:
    # 0 (current), 115 < 120 -> 0, 130 - 120, 105 < 110 -> 0, 0 (current), 101 - 100.
    assert lag.versions.n == 6 and lag.versions.total == 7 and lag.versions.max == 3
    assert lag.seconds.n == 6 and lag.seconds.total == pytest.approx(11.0) and lag.seconds.max == 10.0
