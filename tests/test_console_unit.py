"""The console's own rules without a browser: tokens, sessions, origins, command checks,
rate limit, stale commands, the deadman and the config block."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gateway.config import ConfigError, from_dict
from gateway.console.auth import (
    Credential,
    Sessions,
    authenticate,
    check_hash,
    hash_token,
    origin_allowed,
    own_origins,
    verify_token,
)
from gateway.console.config import TOKEN_ENV, ConsoleConfig
from gateway.console.metrics import MetricsTail
from gateway.console.teleop import (
    Command,
    CommandError,
    Deadman,
    RateLimiter,
    StaleFilter,
    parse_command,
    ramp_action,
)

pytestmark = pytest.mark.unit


def test_token_hash_verifies_only_its_token_and_holds_no_plain_text() -> None:
    hashed = hash_token("s3cret-token", iterations=2000)
    assert "s3cret-token" not in hashed
    assert check_hash(hashed) is None
    assert verify_token("s3cret-token", hashed)
    assert not verify_token("s3cret-tokeN", hashed)
    assert not verify_token("s3cret-token", "plain-text")
    assert hash_token("x", iterations=2000) != hash_token("x", iterations=2000)  # salted


def test_authenticate_gives_the_highest_matching_role() -> None:
    viewer, operator = hash_token("v", iterations=2000), hash_token("o", iterations=2000)
    creds = [Credential("viewer", viewer), Credential("operator", operator)]
    assert authenticate("v", creds) == "viewer"
    assert authenticate("o", creds) == "operator"
    assert authenticate("wrong", creds) is None
    assert authenticate("v", [*creds, Credential("operator", viewer)]) == "operator"


def test_sessions_expire_and_end() -> None:
    sessions = Sessions(ttl_s=3600)
    sid = sessions.create("viewer")
    assert sessions.role(sid) == "viewer"
    assert sessions.role("forged") is None and sessions.role(None) is None
    sessions.end(sid)
    assert sessions.role(sid) is None
    expired = Sessions(ttl_s=-1.0)
    assert expired.role(expired.create("operator")) is None


def test_only_the_consoles_own_origin_is_allowed() -> None:
    allowed = own_origins("127.0.0.1", 8080)
    assert origin_allowed("http://127.0.0.1:8080", allowed)
    assert origin_allowed("http://localhost:8080", allowed)
    assert not origin_allowed("http://127.0.0.1:8081", allowed)
    assert not origin_allowed("http://evil.example", allowed)
    assert not origin_allowed(None, allowed)
    assert own_origins("10.0.0.5", 80) == {"http://10.0.0.5:80"}


def test_valid_command_is_parsed() -> None:
    cmd = parse_command({"seq": 3, "t": 1000.5, "env": 1, "axes": [0, 1.0, -0.5]}, 3, 2)
    assert cmd == Command(seq=3, t_ms=1000.5, env=1, axes=(0.0, 1.0, -0.5))


@pytest.mark.parametrize(
    ("msg", "fragment"),
    [
        ("not a dict", "JSON object"),
        ({"seq": -1, "t": 0, "env": 0, "axes": [0, 0, 0]}, "seq"),
        ({"seq": True, "t": 0, "env": 0, "axes": [0, 0, 0]}, "seq"),
        ({"seq": 1, "t": "now", "env": 0, "axes": [0, 0, 0]}, "t must"),
        ({"seq": 1, "t": float("nan"), "env": 0, "axes": [0, 0, 0]}, "t must"),
        ({"seq": 1, "t": 0, "env": 2, "axes": [0, 0, 0]}, "env must"),
        ({"seq": 1, "t": 0, "env": 0, "axes": [0, 0]}, "3 numbers"),
        ({"seq": 1, "t": 0, "env": 0, "axes": [0, 0, 1.5]}, "[-1, 1]"),
        ({"seq": 1, "t": 0, "env": 0, "axes": [0, 0, float("inf")]}, "[-1, 1]"),
        ({"seq": 1, "t": 0, "env": 0, "axes": [0, "x", 0]}, "[-1, 1]"),
    ],
)
def test_bad_command_is_refused_with_a_reason(msg: object, fragment: str) -> None:
    with pytest.raises(CommandError) as info:
        parse_command(msg, 3, 2)
    assert fragment in str(info.value)


def test_rate_limiter_drops_a_flood_and_refills_over_time() -> None:
    limiter = RateLimiter(rate_hz=10.0, burst=2.0)
    assert [limiter.allow(0.0) for _ in range(4)] == [True, True, False, False]
    assert limiter.dropped == 2
    assert limiter.allow(0.1)  # one token back after 1/rate
    assert not limiter.allow(0.1)


def test_stale_and_out_of_order_commands_are_dropped() -> None:
    f = StaleFilter(max_age_s=0.3)

    def cmd(seq: int, t_ms: float) -> Command:
        return Command(seq=seq, t_ms=t_ms, env=0, axes=(0.0,))

    # The page's clock runs 5 s behind the server's: only the change of delay counts.
    assert f.accept(cmd(1, 1000.0), now_ms=6000.0)
    assert f.accept(cmd(2, 1050.0), now_ms=6060.0)
    assert not f.accept(cmd(2, 1100.0), now_ms=6100.0)  # repeated seq
    assert not f.accept(cmd(3, 1100.0), now_ms=6500.0)  # arrived 400 ms late
    assert f.accept(cmd(4, 1500.0), now_ms=6510.0)
    assert f.dropped == 2


def test_deadman_holds_after_its_timeout_or_when_told() -> None:
    d = Deadman(timeout_s=0.5)
    assert not d.alive(0.0) and d.reason == "no command yet"
    d.feed(1.0)
    assert d.alive(1.4)
    assert not d.alive(1.6) and "no command for 0.5 s" in d.reason
    d.feed(2.0)
    d.hold("window blurred")
    assert not d.alive(2.1) and d.reason == "window blurred"


def test_console_block_is_off_by_default_on_loopback_port_8080() -> None:
    c = from_dict({}).console
    assert (c.enabled, c.host, c.port) == (False, "127.0.0.1", 8080)


def test_console_block_refuses_a_plain_text_token_and_bad_limits() -> None:
    with pytest.raises(ConfigError, match="operator_token_hash"):
        ConsoleConfig(operator_token_hash="hunter2")
    with pytest.raises(ConfigError, match="deadman_s"):
        ConsoleConfig(deadman_s=0)
    with pytest.raises(ConfigError, match="port"):
        ConsoleConfig(port=70000)
    with pytest.raises(ConfigError, match="release_ramp_s"):
        ConsoleConfig(release_ramp_s=-0.1)
    assert ConsoleConfig(release_ramp_s=0).release_ramp_s == 0


def test_a_release_ramp_blends_the_held_command_into_the_policys() -> None:
    held, policy = np.array([0.2, -0.1, 0.0]), np.array([0.6, 0.3, -0.4])
    np.testing.assert_allclose(ramp_action(held, policy, 0.0), held)
    np.testing.assert_allclose(ramp_action(held, policy, 0.5), [0.4, 0.1, -0.2])
    np.testing.assert_allclose(ramp_action(held, policy, 1.0), policy)
    np.testing.assert_allclose(ramp_action(held, policy, 1.5), policy)  # never past the policy's


def test_binding_beyond_loopback_needs_a_token() -> None:
    exposed = ConsoleConfig(enabled=True, host="0.0.0.0")
    with pytest.raises(ConfigError, match="no token"):
        exposed.check_exposure(environ={})
    exposed.check_exposure(environ={TOKEN_ENV: "s3cret"})
    ConsoleConfig(host="0.0.0.0", viewer_token_hash=hash_token("v", iterations=2000)).check_exposure(
        environ={}
    )
    ConsoleConfig(host="127.0.0.1").check_exposure(environ={})


def test_environment_token_becomes_an_operator_hash() -> None:
    creds = ConsoleConfig().credentials(environ={TOKEN_ENV: "from-env"})
    assert [c.role for c in creds] == ["operator"]
    assert "from-env" not in creds[0].hashed and verify_token("from-env", creds[0].hashed)


def test_metrics_tail_follows_the_file_and_skips_torn_and_corrupt_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path, max_points=3)
    assert tail.series() == {}  # no file yet
    lines = [
        {"t": 1.0, "service": "up", "steps_per_s": 10.0, "policy_lag": {"mean": 0.5}},
        {"t": 2.0, "service": "trainer", "eval": {"success_rate": 0.25}, "critic_loss": 1.5},
        {"t": 3.0, "service": "gateway", "steps_per_s": 99.0},  # not the up service's line
    ]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\nnot json\n" + '{"t": 4.0, "serv')
    s = tail.series()
    assert s["steps_per_s"] == {"x": [1.0], "y": [10.0]}
    assert s["policy_lag_mean"]["y"] == [0.5]
    assert s["success_rate"]["y"] == [0.25] and s["critic_loss"]["y"] == [1.5]
    with path.open("a") as f:  # the torn line is completed; more lines follow
        f.write('ice": "up", "steps_per_s": 20.0}\n')
        for t in (5.0, 6.0, 7.0):
            f.write(json.dumps({"t": t, "service": "up", "steps_per_s": t}) + "\n")
    assert tail.series()["steps_per_s"] == {"x": [5.0, 6.0, 7.0], "y": [5.0, 6.0, 7.0]}  # newest 3


def test_metrics_tail_groups_hops_replay_tables_and_keeps_the_newest_lag_histogram(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    hops = {"policy": {"p50": 60.0, "p99": 900.0}, "env_step": {"p50": 5000.0, "p99": 9000.0}}
    table = {"size": 50, "max_size": 200, "rate_limiter": {"inserts": 100, "samples": 400}}
    lines = [
        {
            "t": 1.0,
            "service": "gateway",
            "hops_us": hops,
            "intervention_rate": 0.25,
            "policy_lag_hist": {"0": 5, "1": 2},
        },
        {
            "t": 2.0,
            "service": "replay",
            "tables": {"online": table, "demos": {"size": 0, "max_size": 10, "rate_limiter": {"inserts": 0}}},
        },
        {
            "t": 3.0,
            "service": "gateway",
            "hops_us": {"policy": "garbage"},
            "policy_lag_hist": {"0": 9, "1": 3},
        },
        {"t": 4.0, "service": "gateway", "policy_lag_hist": {"0": "not a count"}},
    ]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    tail = MetricsTail(path)
    s = tail.series()
    assert s["hop_p50/policy"] == {"x": [1.0], "y": [60.0]} and s["hop_p99/env_step"]["y"] == [9000.0]
    assert s["intervention_rate"]["y"] == [0.25]
    assert s["replay_fill/online"]["y"] == [0.25] and s["samples_per_insert/online"]["y"] == [4.0]
    assert s["replay_fill/demos"]["y"] == [0.0] and "samples_per_insert/demos" not in s  # nothing inserted
    assert tail.histograms() == {"policy_lag": {"0": 9, "1": 3}}  # the newest valid one


def test_the_event_loop_estop_answers_from_a_real_control_socket_and_times_out_without_one():
    """``estop_async`` on the server's loop: a real gateway control line (its own thread)
    answers it; with no gateway behind the address it raises Timeout by its deadline,
    and the next call works again on a fresh socket."""
    import asyncio

    import zmq

    from gateway.console.link import GatewayLink
    from gateway.hub.estop import ControlLine
    from gateway.hub.state import Collection
    from gateway.protocol import Timeout

    ctx = zmq.Context.instance()
    state = Collection()
    line = ControlLine(ctx, "tcp://127.0.0.1:0", state, sessions=lambda: 0)
    line.start()
    link = GatewayLink({"gateway": {"control": line.address, "clients": ""}}, interval_s=1.0)
    try:
        reply = asyncio.run(link.estop_async(True, "unit test"))
        assert reply["estopped"] is True and state.estopped and state.estops == 1
    finally:
        line.close()
    with pytest.raises(Timeout, match="no answer"):
        asyncio.run(link.estop_async(True, "nobody there", timeout_s=0.3))
    link._status_client.close()
    link._stop_client.close()


def test_the_console_takes_its_run_folder_as_the_other_commands_do(tmp_path: Path) -> None:
    """``loopgate console RUN``, as ``loopgate report RUN`` and ``loopgate scale RUN`` take
    it (the positional folder was refused as an unrecognised argument), or ``--run-dir``."""
    from tests.conftest import loopgate

    missing = tmp_path / "no-such-run"
    for args in ([str(missing)], ["--run-dir", str(missing)]):
        out = loopgate("console", *args, timeout=60)
        assert out.returncode == 2, out.stderr
        assert "cannot start the console" in out.stderr and str(missing) in out.stderr, out.stderr
    both = loopgate("console", str(missing), "--run-dir", str(tmp_path), timeout=60)
    assert both.returncode == 2 and "two run folders given" in both.stderr, both.stderr
    neither = loopgate("console", timeout=60)
    assert neither.returncode == 2 and "give the run folder" in neither.stderr, neither.stderr
