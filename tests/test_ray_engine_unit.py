"""The engine layer without a cluster: config, placement, addresses, the scale command."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from gateway.config import ConfigError, from_dict
from gateway.engines.scaling import parse_target, request_scale
from tests.conftest import REPO, loopgate, wait_for

pytestmark = pytest.mark.unit


def test_the_local_engine_and_loopgate_up_never_import_ray():
    code = (
        "import sys\n"
        "import gateway.supervisor, gateway.cli\n"
        "from gateway.config import from_dict\n"
        "from gateway.engines import open_engine\n"
        "engine = open_engine(from_dict({}))\n"
        "assert engine.name == 'local' and engine.launcher(None, None) is None\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_placement_is_found_by_name_then_longest_prefix():
    cfg = from_dict(
        {
            "run": {
                "engine": "ray",
                "placement": {
                    "worker": {"resources": {"cpu_node": 1}},
                    "worker-0": {"num_cpus": 2, "labels": {"loopgate/host": "arm0"}},
                    "inference": {"num_gpus": 1, "memory_mb": 2048},
                },
            }
        }
    )
    assert cfg.run.placement_for("worker-0").labels == {"loopgate/host": "arm0"}
    assert cfg.run.placement_for("worker-3").resources == {"cpu_node": 1.0}
    assert cfg.run.placement_for("inference-1").num_gpus == 1.0
    assert cfg.run.placement_for("gateway").num_cpus == 1.0  # the default


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"engine": "kubernetes"}, "run.engine must be one of 'local', 'ray', got 'kubernetes'"),
        ({"placement": {"worker": {"num_cpus": -1}}}, "run.placement.worker: num_cpus must be >= 0"),
        ({"placement": {"worker": {"gpus": 1}}}, "run.placement.worker: unknown key(s) gpus"),
        ({"placement": {"trainer": {"resources": {"gpu_node": 0}}}}, "resources.gpu_node must be > 0"),
        ({"trainer_strategy": "SCATTER"}, "run.trainer_strategy must be one of"),
    ],
)
def test_bad_engine_settings_name_the_field(run, message):
    with pytest.raises(ConfigError) as err:
        from_dict({"run": run})
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"nproc": 2, "min_nproc": 3}, "trainer.min_nproc must be between 1 and trainer.nproc (2), got 3"),
        ({"nproc": 2, "min_nproc": 0}, "trainer.min_nproc must be between 1 and trainer.nproc (2), got 0"),
        (
            {"nproc": 4, "min_nproc": 2, "batch_size": 8},
            "trainer.batch_size (8) must divide evenly over every world size from trainer.min_nproc "
            "to trainer.nproc; it does not over 3",
        ),
        ({"nproc": 2, "min_nproc": 1, "shrink_after_s": 0}, "trainer.shrink_after_s must be > 0, got 0"),
    ],
)
def test_bad_elastic_trainer_settings_name_the_field(trainer, message):
    with pytest.raises(ConfigError) as err:
        from_dict({"trainer": trainer})
    assert message in str(err.value)


def test_the_trainer_tries_its_world_sizes_largest_first():
    assert from_dict({"trainer": {"nproc": 4, "min_nproc": 2, "batch_size": 12}}).trainer.world_sizes() == [
        4,
        3,
        2,
    ]
    assert from_dict({"trainer": {"nproc": 2}}).trainer.world_sizes() == [2]


def test_a_rank_group_refuses_fallback_sizes_it_cannot_shrink_to():
    from gateway.engines.ray_ranks import RankGroup

    with pytest.raises(ValueError, match=r"trainer: smaller world sizes must be in \[1, 1\], got \[2\]"):
        RankGroup("trainer", [{"CPU": 1}] * 2, "PACK", ["python"], {}, "/dev/null", smaller=[2])


def test_actor_options_and_bundles_carry_every_reservation():
    from gateway.config import Placement
    from gateway.engines.ray_engine import actor_options, bundle

    p = Placement(num_cpus=2, num_gpus=1, memory_mb=512, resources={"robot_arm0": 1}, labels={"host": "a"})
    assert actor_options(p) == {
        "num_cpus": 2,
        "num_gpus": 1,
        "memory": 512 << 20,
        "resources": {"robot_arm0": 1},
        "label_selector": {"host": "a"},
    }
    assert bundle(p) == {"CPU": 2, "GPU": 1, "memory": float(512 << 20), "robot_arm0": 1}


@pytest.mark.parametrize("launcher", ["trainer.torchrun", "torch.distributed.run"])
def test_each_rank_runs_the_trainer_itself_instead_of_torchrun(launcher):
    from gateway.engines.ray_engine import rank_argv

    argv = [
        "/venv/bin/python",
        "-m",
        launcher,
        "--standalone",
        "--nproc_per_node=2",
        "--log-dir=/run/logs/torchrun",
        "-m",
        "trainer",
        "--config",
        "/run/config.yaml",
    ]
    assert rank_argv(argv) == ["/venv/bin/python", "-m", "trainer", "--config", "/run/config.yaml"]
    assert rank_argv(["python", "-m", "trainer"]) == ["python", "-m", "trainer"]


def test_a_placed_service_binds_its_nodes_ip():
    from gateway.engines.ray_engine import rehost

    endpoints = {
        "gateway": {"workers": "tcp://0.0.0.0:5001", "control": "tcp://0.0.0.0:5002"},
        "inference": [{"requests": "tcp://0.0.0.0:6001"}, {"requests": "tcp://0.0.0.0:6004"}],
        "metrics": {"inference-1": "http://0.0.0.0:7001/metrics", "gateway": "http://0.0.0.0:7002/metrics"},
    }
    assert rehost(endpoints, "inference-1", "10.0.0.7")
    assert endpoints["inference"][1] == {"requests": "tcp://10.0.0.7:6004"}
    assert endpoints["inference"][0] == {"requests": "tcp://0.0.0.0:6001"}
    assert endpoints["metrics"]["inference-1"] == "http://10.0.0.7:7001/metrics"
    assert not rehost(endpoints, "inference-1", "10.0.0.7")  # unchanged: nothing to write
    assert not rehost(endpoints, "worker-0", "10.0.0.8")  # binds nothing
    assert rehost(endpoints, "gateway", "10.0.0.8")
    assert endpoints["gateway"]["control"] == "tcp://10.0.0.8:5002"


def test_loopback_addresses_on_a_cluster_of_several_hosts_are_refused():
    from gateway.engines.ray_engine import check_cluster

    cfg = from_dict({"run": {"engine": "ray"}})
    one_host = [{"NodeManagerAddress": "10.0.0.1", "Resources": {}}] * 3
    check_cluster(cfg, one_host, "10.0.0.1")
    with pytest.raises(ConfigError, match=r"gateway.host .127.0.0.1. is loopback .*10\.0\.0\.2"):
        check_cluster(cfg, [*one_host, {"NodeManagerAddress": "10.0.0.2", "Resources": {}}], "10.0.0.1")
    # A node of this machine at a loopback IP of its own (ray start --node-ip-address 127.0.0.2).
    check_cluster(cfg, [*one_host, {"NodeManagerAddress": "127.0.0.2", "Resources": {}}], "10.0.0.1")


def test_a_service_binds_its_nodes_loopback_ip_and_otherwise_the_configured_host():
    from gateway.engines.ray_engine import bind_host

    assert bind_host("127.0.0.1", "127.0.0.2") == "127.0.0.2"  # a node of its own on this machine
    assert bind_host("127.0.0.1", "10.0.0.1") == "127.0.0.1"  # loopback as configured, no CURVE needed
    assert bind_host("0.0.0.0", "10.0.0.7") == "10.0.0.7"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("env.workers", "expected env.workers=N"),
        ("inference.max_batch=4", "expected env.workers=N"),
        ("env.workers=two", "env.workers must be an integer, got 'two'"),
        ("env.workers=0", "env.workers must be >= 1, got 0"),
    ],
)
def test_bad_scale_targets_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_target(text)
    assert parse_target("env.workers= 3") == ("env.workers", 3)


def test_scale_without_a_live_run_fails_and_withdraws_its_request(tmp_path):
    (tmp_path / "endpoints.json").write_text("{}")
    result = loopgate("scale", str(tmp_path), "env.workers=3", "--timeout", "1", timeout=60)
    assert result.returncode == 1
    assert "no loopgate up answered" in result.stderr
    assert list((tmp_path / "requests").iterdir()) == []
    result = loopgate("scale", str(tmp_path / "nope"), "env.workers=3", timeout=60)
    assert result.returncode == 2 and "is not a run folder" in result.stderr
    result = loopgate("scale", str(tmp_path), "env.workers=-1", timeout=60)
    assert result.returncode == 2 and "must be >= 1" in result.stderr


def test_a_claimed_scale_request_gets_its_answer(tmp_path):
    """The driver's side of the exchange, run by hand: claim the request, answer it."""
    (tmp_path / "endpoints.json").write_text("{}")
    answer = {"ok": True, "env.workers": 3}

    def driver() -> None:
        folder = tmp_path / "requests"
        wait_for(lambda: folder.is_dir() and list(folder.glob("scale-*.json")), timeout=15, what="a request")
        request = next(folder.glob("scale-*.json"))
        assert json.loads(request.read_text()) == {"env.workers": 3}
        request.rename(request.with_suffix(".taken"))
        (folder / f"{request.stem}.done.json").write_text(json.dumps(answer))

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    assert request_scale(tmp_path, "env.workers", 3, timeout_s=20) == answer
    thread.join(timeout=5)


def test_up_with_no_ray_cluster_at_the_address_fails_at_once_with_exit_2(tmp_path):
    from gateway.services import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = loopgate(
        "up",
        str(REPO / "configs" / "collect_pd.yaml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--ray",
        address,
        timeout=90,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"run.ray_address '{address}': no Ray cluster answers there" in result.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
