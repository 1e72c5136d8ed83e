"""``loopgate report``: a real run's stages, bottleneck, model and trace, read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import loopgate

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 workers x 4 MuJoCo envs under the PD controller, about three seconds of steps."""
    run = tmp_path_factory.mktemp("report") / "run"
    out = loopgate(
        "up", "configs/collect_pd.yaml", "--run-dir", str(run), "--max-env-steps", "12000",
        "--set", "env.num_envs=4", "--set", "run.status_interval_s=0.2",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return run


def test_report_names_every_stage_its_busy_share_and_the_bottleneck(collected, tmp_path):
    out = loopgate(
        "report", str(collected), "--json", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.png")
    )
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    names = [s["name"] for s in report["stages"]]
    assert names[:2] == ["env workers (2 x 4 envs)", "gateway"]
    busy = [s["busy"] for s in report["stages"] if s["busy"] is not None]
    assert busy and all(0.0 < b <= 1.0 for b in busy), report["stages"]
    assert report["bottleneck"] in names and f"bottleneck: {report['bottleneck']}" in out.stdout
    assert report["steps_per_s"] > 0 and report["predicted_steps_per_s"] > 0
    assert {"capture_to_gateway", "gateway", "env_step", "action_to_worker", "spool_write"} <= set(
        report["hops_us"]
    )
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_report_trace_follows_sampled_steps_across_processes(collected, tmp_path):
    out = loopgate("report", str(collected), "--trace", str(tmp_path / "trace.json"))
    assert out.returncode == 0, out.stderr
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"env worker", "gateway", "wire"} <= tracks
    spans = [e for e in events if e["ph"] == "X"]
    by_seq: dict[tuple[str, int], list[dict]] = {}
    for e in spans:
        by_seq.setdefault((e["args"]["worker"], e["args"]["seq"]), []).append(e)
    assert by_seq
    for parts in by_seq.values():  # one step end to end, each part after the one before
        order = ["observation to gateway", "observation in to action out", "action to worker", "env step"]
        starts = {e["name"]: e["ts"] for e in parts}
        assert [starts[n] for n in order] == sorted(starts[n] for n in order), parts
        assert all(e["dur"] >= 0 for e in parts)


def test_a_saturated_gateway_is_at_most_all_of_the_time_busy(tmp_path):
    """The first record's ``busy_s`` leaves out the loop turn it was written in, which the
    last one counts: a gateway busy all the time came out a few tenths over 100 %."""
    from gateway.report import stages

    (tmp_path / "config.yaml").write_text("env: {backend: mujoco_reach, workers: 2, num_envs: 4}\n")
    hops = {"gateway": {"p50": 250.0}, "env_step": {"p50": 140.0}}
    records = [
        {"t": 100.0, "service": "gateway", "env_steps": 0, "busy_s": 1.0, "hops_us": hops},
        {"t": 110.0, "service": "gateway", "env_steps": 50_000, "busy_s": 11.03, "hops_us": hops},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    found, _ = stages(tmp_path)
    gateway = next(s for s in found if s.name == "gateway")
    assert gateway.busy == 1.0 and gateway.throughput == 5000.0


def test_report_of_a_folder_that_is_no_run_says_so(tmp_path):
    out = loopgate("report", str(tmp_path))
    assert out.returncode == 2 and "is not a run folder" in out.stderr


def write_run(path: Path, records: list[dict]) -> None:
    (path / "config.yaml").write_text("env: {backend: mujoco_reach, workers: 2, num_envs: 8}\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_restarted_gateway_and_inference_server_are_measured_over_their_lifetimes(tmp_path):
    """A service restarted mid-run (killed, or the run folder continued by a second
    ``loopgate up``) counts from zero again: the gateway's ``busy_s`` and an inference
    server's batches, rows and compute time (its ``env_steps`` go on from the spool). Its
    spans are summed over its lifetimes, and the restart's gap counts in neither: measured
    in a real run with the gateway killed (SIGKILL) after 6 s, the span across the restart
    gave 9 377 steps/s at 40 % busy, its lifetimes 11 768 at 64 %."""
    from gateway.report import stages

    hops = {"gateway": {"p50": 130.0}, "env_step": {"p50": 190.0}}

    def infer(count: int, total_us: float) -> dict:
        return {"n": count, "total": total_us, "b": {}}

    records = [
        {"t": 100.0, "service": "gateway", "uptime_s": 1.0, "env_steps": 0, "busy_s": 0.1, "hops_us": hops},
        {
            "t": 104.0,
            "service": "gateway",
            "uptime_s": 5.0,
            "env_steps": 40_000,
            "busy_s": 2.5,
            "hops_us": hops,
        },
        {"t": 100.0, "service": "inference-0", "batches": 0, "rows": 0, "infer_us": infer(0, 0.0)},
        {"t": 104.0, "service": "inference-0", "batches": 1000, "rows": 4000, "infer_us": infer(1000, 1e6)},
        # Both restarted after 4 s away: the gateway's steps go on, every other counter starts again.
        {
            "t": 108.0,
            "service": "gateway",
            "uptime_s": 0.5,
            "env_steps": 40_000,
            "busy_s": 0.05,
            "hops_us": hops,
        },
        {
            "t": 112.0,
            "service": "gateway",
            "uptime_s": 4.5,
            "env_steps": 80_000,
            "busy_s": 2.45,
            "hops_us": hops,
        },
        {"t": 108.0, "service": "inference-0", "batches": 5, "rows": 20, "infer_us": infer(5, 5e3)},
        {
            "t": 112.0,
            "service": "inference-0",
            "batches": 1005,
            "rows": 4020,
            "infer_us": infer(1005, 1.005e6),
        },
    ]
    write_run(tmp_path, records)
    found, facts = stages(tmp_path)
    by_name = {s.name: s for s in found}
    assert facts["seconds"] == 8.0 and facts["steps_per_s"] == 10_000.0
    assert by_name["gateway"].busy == pytest.approx(4.8 / 8.0)
    inference = by_name["inference-0"]
    assert inference.throughput == 1000.0 and inference.busy == pytest.approx(0.25)
    assert inference.note == "batch 4.0 rows on average"


def test_a_run_that_collected_nothing_names_no_bottleneck(tmp_path):
    """A run that never stepped (its robot never answered): every stage is idle, and the
    report says so instead of naming one of them the bottleneck."""
    hops: dict = {}
    write_run(
        tmp_path,
        [
            {
                "t": 100.0 + i,
                "service": "gateway",
                "uptime_s": 1.0 + i,
                "env_steps": 0,
                "busy_s": 0.001 * i,
                "hops_us": hops,
            }
            for i in range(5)
        ],
    )
    out = loopgate("report", str(tmp_path), "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    assert "no env steps were collected" in out.stdout and "bottleneck:" not in out.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["bottleneck"] is None and report["predicted_steps_per_s"] == 0.0


def test_a_run_shorter_than_a_few_metrics_records_is_measured_while_it_collected(tmp_path):
    """A ``collect_pd`` run of 300 steps (about a second) once read "no env steps were
    collected": the gateway's first record came a second after it started, with every
    step already counted. The gateway now writes one as it starts, and the span runs from
    the last record before the steps moved to the first at their last value (the wait for
    the workers, and the idle tail after the budget, left out); the report says the
    figures are rough."""
    hops = {"gateway": {"p50": 130.0}, "env_step": {"p50": 170.0}}
    records = [
        {"t": 100.0 + t, "service": "gateway", "uptime_s": t, "env_steps": n, "busy_s": b, "hops_us": hops}
        for t, n, b in ((0.0, 0, 0.0), (1.0, 320, 0.019), (2.1, 320, 0.024), (2.3, 320, 0.026))
    ]
    write_run(tmp_path, records)
    out = loopgate("report", str(tmp_path), "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    assert "collection spanned 1.0 s of metrics records" in out.stdout and "rough" in out.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["steps_per_s"] == 320.0 and report["bottleneck"] == "gateway", report
