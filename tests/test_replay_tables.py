"""Replay tables: items, samplers, removers, rate limiters and config checks (in process).

Also home of :func:`episode_chunks`, which the other replay tests import.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from gateway.config import ConfigError, from_dict
from gateway.protocol import Message
from gateway.trajectory import StepRows
from trainer.replay.config import ReplayConfig, TableConfig
from trainer.replay.core import ReplayBuffer, Waiting
from trainer.replay.rate_limiter import RateLimiter
from trainer.replay.storage import START_WAIT_S

pytestmark = pytest.mark.unit


def episode_chunks(
    episode: str,
    steps: int,
    *,
    per_chunk: int = 4,
    end: str | None = "truncated",
    final: bool = True,
    eval: bool = False,
    obs_size: int = 3,
    start: int = 0,
) -> list[Message]:
    """Chunks of one episode whose ``obs/q`` and ``action`` hold the step index."""
    rows = StepRows(episode, "w0", 0, "reach", eval)
    for s in range(start, start + steps):
        last = s == start + steps - 1
        rows.add(
            {"q": np.full(obs_size, s, np.float32)},
            np.full(2, s, np.float32),
            reward=float(s),
            terminated=last and end == "terminated",
            truncated=last and end == "truncated",
            success=False,
            policy_version=1,
            t_capture=1_700_000_000.0 + s * 0.05,
            t_action=1_700_000_000.0 + s * 0.05,
            step=s,
        )
    out = []
    while len(rows):
        first = rows.first_step
        k = min(per_chunk - first % per_chunk, len(rows))
        head = rows.take(k)
        done = not len(rows)
        fo = (
            {"q": np.full(obs_size, start + steps, np.float32)}
            if done and final and end != "interrupted"
            else None
        )
        out.append(head.to_chunk(end=end if done else None, final_obs=fo))
    return out


def buffer(*tables: TableConfig, **kw) -> ReplayBuffer:
    return ReplayBuffer(ReplayConfig(tables=list(tables) or [TableConfig()], **kw))


def fill(buf: ReplayBuffer, chunks: list[Message]) -> None:
    for chunk in chunks:
        buf.insert(chunk)


def test_transitions_pair_each_step_with_the_next_observation_across_chunks():
    buf = buffer(TableConfig(max_size=100))
    fill(buf, episode_chunks("a", 10))
    assert buf.tables["online"].size == 10
    batch = buf.sample({"online": 64})
    np.testing.assert_array_equal(batch["next_obs/q"][:, 0], batch["obs/q"][:, 0] + 1)
    np.testing.assert_array_equal(batch["reward"], batch["obs/q"][:, 0])
    last = batch["obs/q"][:, 0] == 9
    assert batch["truncated"][last].all() and not batch["truncated"][~last].any()


def test_a_chunks_last_step_waits_for_the_next_chunk():
    buf = buffer(TableConfig(max_size=100))
    chunks = episode_chunks("a", 8)
    buf.insert(chunks[0])
    assert buf.tables["online"].size == 3  # step 3 has no next observation yet
    buf.insert(chunks[1])
    assert buf.tables["online"].size == 8


def test_interrupted_episodes_lose_only_the_step_without_a_next_observation():
    buf = buffer(TableConfig(max_size=100))
    fill(buf, episode_chunks("a", 6, end="interrupted"))
    assert buf.tables["online"].size == 5


def test_evaluation_chunks_never_reach_a_table():
    buf = buffer(TableConfig(max_size=100), TableConfig(name="demos", source="demos", max_size=100))
    fill(buf, episode_chunks("e", 8, eval=True))
    assert all(t.size == 0 and t.pending_items == 0 for t in buf.tables.values())
    for chunk in episode_chunks("d", 8):
        buf.insert(chunk, "demos")
    assert buf.tables["demos"].size == 8 and buf.tables["online"].size == 0


def test_out_of_order_chunks_wait_for_the_gap():
    buf = buffer(TableConfig(max_size=100))
    c = episode_chunks("a", 12)
    for chunk in (c[0], c[2], c[1]):
        buf.insert(chunk)
    assert buf.tables["online"].size == 12


def test_an_episodes_first_chunk_arriving_after_its_second_waits_in_order():
    """A resend after a reconnect can bring chunk 1 of an episode before chunk 0: the
    episode starts at step 0, never at the first chunk that happens to arrive."""
    buf = buffer(TableConfig(max_size=100))
    c = episode_chunks("a", 12)
    for chunk in (c[1], c[2], c[0]):
        buf.insert(chunk)
    assert buf.tables["online"].size == 12 and buf.index.late_chunks == 0
    batch = buf.sample({"online": 64})
    np.testing.assert_array_equal(batch["next_obs/q"][:, 0], batch["obs/q"][:, 0] + 1)


def test_an_online_episode_whose_step_0_never_comes_starts_at_its_first_chunk_in_time():
    """Its first steps were never acknowledged (a gateway killed before spooling them) or
    retention retired them from the log: its later chunks wait for step 0 only so long."""
    buf = buffer(TableConfig(max_size=100))
    buf.rebuilding = True
    for chunk in episode_chunks("a", 12)[1:]:
        buf.insert(chunk)
    buf.restored()
    assert buf.tables["online"].size == 0  # held: a live resend may still bring step 0
    assert buf.settle(time.monotonic()) == 0
    assert buf.settle(time.monotonic() + START_WAIT_S) == 8
    assert buf.tables["online"].size == 8
    buf.insert(episode_chunks("b", 4)[0])  # and the index goes on with the next episode
    assert buf.tables["online"].size == 12


def test_a_demonstration_starts_where_its_take_began():
    """A console take cut from the middle of an episode is sampleable at once."""
    buf = buffer(TableConfig(name="demos", source="demos", max_size=100))
    for chunk in episode_chunks("take", 6, start=40, per_chunk=100):
        buf.insert(chunk, "demos")
    assert buf.tables["demos"].size == 6


def test_nstep_items_sum_discounted_rewards_and_bootstrap():
    buf = buffer(TableConfig(item="nstep", n_step=3, gamma=0.5, max_size=100))
    fill(buf, episode_chunks("a", 10, end="terminated"))
    batch = buf.sample({"online": 200})
    s = batch["obs/q"][:, 0].astype(int)
    for i, step in enumerate(s):
        k = min(3, 10 - step)
        want = sum(0.5**j * (step + j) for j in range(k))
        assert batch["reward"][i] == pytest.approx(want)
        if step + k == 10:  # ends in the terminal step
            assert batch["terminated"][i] and batch["discount"][i] == 0
        else:
            assert batch["discount"][i] == pytest.approx(0.5**3)
            assert batch["next_obs/q"][i, 0] == step + 3


def test_transitions_carry_the_tables_discount_and_zero_after_termination():
    buf = buffer(TableConfig(item="transition", gamma=0.9, max_size=100))
    fill(buf, episode_chunks("a", 10, end="terminated"))
    batch = buf.sample({"online": 200})
    last = batch["terminated"].astype(bool)
    assert last.any() and (~last).any()
    assert np.all(batch["discount"][last] == 0)
    assert np.allclose(batch["discount"][~last], 0.9)


def test_sequences_are_fixed_length_slices():
    buf = buffer(TableConfig(item="sequence", sequence_length=4, sequence_stride=2, max_size=100))
    fill(buf, episode_chunks("a", 11))
    assert buf.tables["online"].size == 4  # starts 0, 2, 4, 6
    batch = buf.sample({"online": 16})
    assert batch["obs/q"].shape == (16, 4, 3)
    starts = batch["obs/q"][:, 0, 0]
    np.testing.assert_array_equal(batch["obs/q"][:, :, 0], starts[:, None] + np.arange(4))


def test_fifo_remover_keeps_the_newest_items():
    buf = buffer(TableConfig(max_size=5))
    fill(buf, episode_chunks("a", 20))
    batch = buf.sample({"online": 100})
    assert set(batch["obs/q"][:, 0].astype(int)) == {15, 16, 17, 18, 19}


def test_fifo_and_lifo_samplers_take_the_oldest_and_newest():
    buf = buffer(
        TableConfig(name="f", sampler="fifo", max_size=50), TableConfig(name="l", sampler="lifo", max_size=50)
    )
    fill(buf, episode_chunks("a", 20))
    assert buf.sample({"f": 3})["obs/q"][:, 0].tolist() == [0, 1, 2]
    assert buf.sample({"l": 3})["obs/q"][:, 0].tolist() == [19, 18, 17]


def test_max_times_sampled_removes_items():
    buf = buffer(TableConfig(sampler="fifo", max_size=50, max_times_sampled=1))
    fill(buf, episode_chunks("a", 8))
    seen = [buf.sample({"online": 4})["obs/q"][:, 0].tolist() for _ in range(2)]
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(Waiting, match="empty"):
        buf.sample({"online": 1})


def test_priorities_from_the_trainer_steer_sampling():
    buf = buffer(TableConfig(sampler="prioritized", priority_exponent=1.0, max_size=100))
    fill(buf, episode_chunks("a", 10))
    batch = buf.sample({"online": 10})
    keys, steps = batch["key"], batch["obs/q"][:, 0]
    prios = np.where(steps == steps[0], 1000.0, 1e-3)
    assert buf.update_priorities(keys, prios) == len(keys)
    again = buf.sample({"online": 500})
    assert np.mean(again["obs/q"][:, 0] == steps[0]) > 0.9
    assert again["probability"].max() > 0.9


def test_mixing_tables_gives_exact_shares():
    buf = buffer(TableConfig(max_size=100), TableConfig(name="demos", source="demos", max_size=100))
    fill(buf, episode_chunks("a", 10))
    for chunk in episode_chunks("d", 10):
        buf.insert(chunk, "demos")
    batch = buf.sample({"demos": 128, "online": 128})
    assert batch["obs/q"].shape[0] == 256
    assert (batch["table"] == 0).sum() == 128 and (batch["table"] == 1).sum() == 128


def test_sample_requests_that_cannot_make_one_batch_are_refused():
    from gateway.protocol import ProtocolError

    buf = buffer(TableConfig(max_size=10), TableConfig(name="seq", item="sequence", max_size=10))
    fill(buf, episode_chunks("a", 10))
    for counts, match in (
        ({"online": 0}, "batch size"),
        ({"online": 1 << 30}, "batch size"),
        ({"online": 2, "seq": 2}, "one batch needs one shape"),
        ({"nope": 2}, "no table 'nope'"),
        ({"online": -1}, ">= 0"),
    ):
        with pytest.raises(ProtocolError, match=match):
            buf.sample(counts)


def test_sampling_waits_for_min_size_and_the_ratio():
    buf = buffer(TableConfig(max_size=1000, min_size_to_sample=8, samples_per_insert=2.0, error_buffer=4.0))
    fill(buf, episode_chunks("a", 4, end="truncated"))
    with pytest.raises(Waiting, match="min_size_to_sample"):
        buf.sample({"online": 1})
    fill(buf, episode_chunks("b", 4))
    # diff = inserts * 2 - samples must stay >= 8 * 2 - 4: 8 inserts allow 4 sampled items
    buf.sample({"online": 4})
    with pytest.raises(Waiting, match="samples_per_insert"):
        buf.sample({"online": 4})


def test_inserts_wait_for_the_trainer_and_resume_when_it_samples():
    buf = buffer(TableConfig(max_size=1000, min_size_to_sample=4, samples_per_insert=1.0, error_buffer=4.0))
    fill(buf, episode_chunks("a", 20))
    table = buf.tables["online"]
    assert table.size == 8 and table.pending_items == 12  # diff <= 4 * 1 + 4
    buf.sample({"online": 4})
    buf.admit()
    assert table.size == 12


def test_the_step_ring_drops_items_of_overwritten_steps():
    buf = buffer(TableConfig(max_size=10_000), storage_steps=64)
    for e in range(10):
        fill(buf, episode_chunks(f"e{e}", 20))
    table = buf.tables["online"]
    assert 0 < table.size <= 64 and table.evicted > 0
    batch = buf.sample({"online": 256})
    np.testing.assert_array_equal(batch["next_obs/q"][:, 0], batch["obs/q"][:, 0] + 1)


def test_a_chunk_with_different_arrays_is_refused_by_name_and_kept_out_of_tables():
    from gateway.protocol import ProtocolError
    from trainer.replay.storage import check_arrays

    buf = buffer()
    fill(buf, episode_chunks("a", 4))
    wide = episode_chunks("b", 4, obs_size=5)[0]
    with pytest.raises(ProtocolError, match="obs/q"):
        check_arrays(wide, buf.store.layout())
    assert buf.insert(wide) == 0 and buf.refused_chunks == 1
    assert buf.tables["online"].size == 4


def test_rate_limiter_counts():
    limiter = RateLimiter(min_size_to_sample=2, samples_per_insert=4.0, error_buffer=8.0)
    assert limiter.can_insert(2) and not limiter.can_sample(1)
    limiter.inserted(2)
    assert limiter.can_sample(8) and not limiter.can_sample(9)  # diff 2 * 4 - n >= 8 - 8
    assert limiter.insertable(100) == 2


@pytest.mark.parametrize(
    ("tables", "match"),
    [
        (
            [{"name": "a"}, {"name": "b", "samples_per_insert": 4, "error_buffer": 1}],
            r"replay\.tables\[1\]\.samples_per_insert .* deadlock",
        ),
        ([{"name": "a"}, {"name": "a"}], r"replay\.tables\[1\]\.name 'a' is used"),
        ([{"name": "a", "max_size": 0}], r"replay\.tables\[0\]\.max_size must be >= 1"),
        ([{"name": "a", "sampler": "random"}], r"replay\.tables\[0\]\.sampler"),
        ([{"name": "a", "samples_per_insert": 4, "max_times_sampled": 2}], "max_times_sampled"),
    ],
)
def test_bad_table_configs_name_the_field(tables, match):
    with pytest.raises(ConfigError, match=match):
        from_dict({"replay": {"tables": tables}})


def test_replay_block_is_off_by_default():
    cfg = from_dict({})
    assert cfg.replay.enabled is False and cfg.replay.tables[0].name == "online"


def test_the_plan_starts_nothing_when_disabled_and_one_service_when_enabled(tmp_path):
    from gateway.services import RunContext
    from trainer.replay.plan import plan_replay

    run = RunContext(run_dir=tmp_path, config_path=tmp_path / "config.yaml", endpoints={})
    assert plan_replay(from_dict({}), run) == [] and run.endpoints == {}
    (service,) = plan_replay(from_dict({"replay": {"enabled": True}}), run)
    assert service.name == "replay" and service.argv[1:3] == ["-m", "trainer.replay"]
    assert set(run.endpoints["replay"]) == {"ingest", "sample", "control"}
    assert all(a.startswith("tcp://127.0.0.1:") for a in run.endpoints["replay"].values())


def test_releasing_rate_limits_admits_waiting_items_once_nobody_samples():
    table = TableConfig(
        max_size=1000, min_size_to_sample=4, samples_per_insert=4.0, error_buffer=8.0, max_pending=5
    )
    buf = buffer(table)
    fill(buf, episode_chunks("a", 40))
    assert buf.pending() > 5 and buf.overloaded()  # the ratio holds inserts back
    admitted = buf.release_rate_limits()
    assert admitted > 0 and buf.pending() == 0 and not buf.overloaded()
    fill(buf, episode_chunks("b", 40))
    assert buf.pending() == 0
