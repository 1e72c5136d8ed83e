"""The performance model's arithmetic: costs from metrics records, fits, and its limits.

The records are written here in the shape the gateway writes them (``env_steps``,
``busy_s``, ``hops_us`` every second); ``loopgate bench --only model`` checks the
model against measured runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.records import Record, finish
from gateway.perf_model import Line, Model, Point, point_from_records, point_from_run

pytestmark = pytest.mark.unit


def records(steps_per_s: float, busy_frac: float, env_us: float, seconds: int = 5) -> list[dict]:
    return [
        {
            "t": 1000.0 + i,
            "service": "gateway",
            "env_steps": int(steps_per_s * i),
            "busy_s": busy_frac * i,
            "hops_us": {"env_step": {"p50": env_us}},
        }
        for i in range(seconds + 1)
    ]


def test_a_one_worker_run_gives_its_per_message_costs_and_overhead() -> None:
    # 1000 messages/s of 2 envs: a 1000 µs cycle, the gateway busy 40 % (400 µs each).
    p = point_from_records(records(2000, 0.4, 100.0), workers=1, num_envs=2)
    assert p.steps_per_s == pytest.approx(2000)
    assert p.gateway_us == pytest.approx(400)
    assert p.overhead_us == pytest.approx(1000 - 400 - 100)
    many = point_from_records(records(2000, 0.4, 100.0), workers=3, num_envs=2)
    assert many.overhead_us is None  # several workers queue behind each other


def test_the_window_leaves_the_warm_up_out_and_needs_two_records() -> None:
    rows = records(2000, 0.4, 100.0)
    rows[0]["env_steps"] = -10_000  # a warm-up that would skew the rate
    p = point_from_records(rows, workers=1, num_envs=2, since=1000.5)
    assert p.steps_per_s == pytest.approx(2000)
    with pytest.raises(ValueError, match="two gateway metrics records"):
        point_from_records(rows, workers=1, num_envs=2, since=1004.5)
    idle = records(0, 0.0, 0.0)
    with pytest.raises(ValueError, match="no steps"):
        point_from_records(idle, workers=1, num_envs=2)


def test_a_run_folder_gives_its_shape_from_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("env: {workers: 1, num_envs: 4}\n")
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in records(4000, 0.5, 120.0)) + "\n"
    )
    p = point_from_run(tmp_path)
    assert (p.workers, p.num_envs) == (1, 4)
    assert p.gateway_us == pytest.approx(500)


def test_lines_fit_exactly_through_two_points_and_scale_one() -> None:
    line = Line.fit([1, 8], [100, 240], proportional=False)
    assert line.at(4) == pytest.approx(160)
    assert Line.fit([2], [100], proportional=True).at(8) == pytest.approx(400)
    assert Line.fit([2], [100], proportional=False).at(8) == pytest.approx(100)
    with pytest.raises(ValueError):
        Line.fit([], [], proportional=True)


def test_the_model_takes_the_tightest_limit_and_names_it() -> None:
    model = Model.fit(
        [
            Point(1, 1, 0.0, env_us=100, gateway_us=200, overhead_us=100),
            Point(1, 8, 0.0, env_us=800, gateway_us=270, overhead_us=100),
        ]
    )
    # 1 x 4: cycle 400 + 230 + 100 = 730 µs, one loop: 4 / 730 µs.
    one = model.predict(workers=1, num_envs=4, cpus=2)
    assert one.limit == "workers" and one.steps_per_s == pytest.approx(4e6 / 730)
    # 8 x 1 on 3 CPUs: the gateway (200 µs a message) caps it below the CPUs' 3 / 400 µs.
    many = model.predict(workers=8, num_envs=1, cpus=3)
    assert many.limit == "gateway" and many.steps_per_s == pytest.approx(1e6 / 200)
    # 3 x 8 on 2 CPUs: the CPUs (2 / 1170 µs) before the gateway (1 / 270 µs).
    cpu = model.predict(workers=3, num_envs=8, cpus=2)
    assert cpu.limit == "cpus" and cpu.steps_per_s == pytest.approx(8 * 2e6 / 1170)
    with pytest.raises(ValueError, match="single worker"):
        Model.fit([Point(2, 1, 0.0, 100, 200, None)])


def test_a_range_target_is_met_only_inside_it() -> None:
    base = Record(name="m", value=100.0, unit="steps/s")
    inside = Record(name="p", value=115.0, unit="steps/s", baseline="m", target="0.8 .. 1.2")
    outside = Record(name="q", value=125.0, unit="steps/s", baseline="m", target="0.8 .. 1.2")
    met = {r.record.name: r.met for r in finish([base, inside, outside])}
    assert met == {"m": None, "p": True, "q": False}
