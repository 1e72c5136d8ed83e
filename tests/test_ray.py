"""The Ray engine on a real three-node Ray cluster on this machine (``ray.cluster_utils``).

What stands for what (``benchmarks/ray_cluster.py``): the head node is a CPU node
(gateway, replay service, a worker), node 2 a GPU node (its GPUs are the custom resource
``gpu_node``: there is no GPU here; the inference replica and both trainer ranks ask for
it, and a worker may run there), node 3 the host of robot ``arm0`` (``robot_arm0``, label
``loopgate/host=arm0``). Everything else is real: ``loopgate up --ray ADDRESS`` as a
process, one Ray actor per service, each service its own process with its own ZeroMQ
sockets, MuJoCo workers, the inference server, the replay service, FSDP over gloo.
One cluster serves the whole module; the tests that remove nodes add them back, at
loopback IPs of their own (127.0.0.2, 127.0.0.3: this machine's other nodes all share its
one address), so the services that move there really bind other addresses.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.ray_cluster import GPU_NODE, PLACEMENT, ROBOT_HOST, ThreeNodes
from gateway.endpoints import lookup
from gateway.endpoints import read as read_endpoints
from gateway.metrics import read_metrics
from tests.conftest import time_left, wait_for
from tests.ray_runs import (
    collection_config,
    env_steps,
    finish,
    learning_config,
    nodes_of,
    on,
    output,
    placements,
    service_states,
    up,
    write,
)

pytestmark = pytest.mark.e2e

SPARE_IP = "127.0.0.2"
"""A node's IP of its own on this machine (any 127.x address is this machine's loopback)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreeNodes]:
    nodes = ThreeNodes()
    try:
        yield nodes
    finally:
        nodes.shutdown()


@pytest.mark.timeout(300)
def test_reach_loop_across_three_nodes_learns_on_an_update_budget(cluster, tmp_path):
    """SAC through the whole loop with every service on the node its placement names: the
    trainer's two ranks in one placement group on the GPU node (FSDP over gloo, rendezvous
    at rank 0's node), ends far above the untrained policy's evaluation after 2500 updates
    (its return, by about +9.5 in repeated runs against a +3 bar)."""
    run = tmp_path / "run"
    proc = up(cluster, write(tmp_path, learning_config()), run)
    summary = finish(proc, run)
    log = output(proc)
    gpu = cluster.gpu
    for service in ("inference-0", "trainer[0]", "trainer[1]"):
        assert [on(gpu, n) for n in nodes_of(proc, service)] == [True], (service, placements(proc))
    assert "trainer: 2 ranks, rendezvous at" in log
    workers = {nodes_of(proc, f"worker-{i}")[0] for i in range(2)}
    assert all(on(cluster.head, n) or on(gpu, n) for n in workers)
    rounds = [
        r["eval"]
        for r in read_metrics(run / "metrics.jsonl")
        if r.get("service") == "trainer" and "eval" in r
    ]
    assert rounds, "the trainer recorded no evaluation round"
    untrained = rounds[0]
    assert untrained["policy_version"] <= 1  # evaluated before the first update
    # The return (minus the distance to the target, summed over an episode) is the steady
    # measure (measured: -11.7 untrained, -1.9 to -2.3 after 2500 updates); the 10 cm
    # success rate rose too (0.2 -> 1.0), but it is the noisier of the two.
    assert summary["eval_return"] > untrained["return_mean"] + 3.0, (rounds, summary)
    assert summary["acked_steps"] == summary["stored_steps"] and summary["duplicate_steps"] == 0
    assert summary["lost_steps"] == 0
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert trainer_log.count("process group closed") == 2, trainer_log[-2000:]


@pytest.mark.timeout(240)
def test_lost_gpu_node_its_services_come_back_elsewhere_and_the_trainer_resumes_smaller(cluster, tmp_path):
    """The GPU node holding the inference replica, the replay service, the trainer's two
    ranks and a worker is removed mid-run, after the trainer's first checkpoint: Ray
    declares it dead, every service restarts on a node that fits (a spare GPU node added
    before the loss, as an autoscaler would).

    The spare is smaller: its ``gpu_node`` (1, where the lost node had 3) holds the
    inference replica and the replay service (0.2 each: they share the GPU node here only
    to be lost with it) and one trainer rank (0.6), never two, whatever is placed first
    (Ray's capacities are whole numbers, demands below 1 may be fractions). The trainer's
    placement group of two ranks finds no room, and after ``trainer.shrink_after_s`` one of
    a single rank (``trainer.min_nproc: 1``) takes its place: the trainer resumes from its
    last DCP checkpoint, resharded from two ranks to one.

    The spare node has an IP of its own (127.0.0.2: this machine's nodes are otherwise all
    at one address), so the restarted inference server and replay service really bind other
    addresses: the driver writes them into endpoints.json and the running gateway follows
    it there. Once the resumed trainer has published, the run is stopped (Ctrl-C): every
    acknowledged step is stored exactly once, and the policy version never goes backwards.
    The smaller spare stays the module's GPU node.

    The trainer has no update budget it could reach first: one that finished between the
    node's loss and Ray declaring it dead is done, rightly not restarted, and the test
    would wait for a placement that never comes (one CI run did)."""
    cfg = collection_config(
        placement={
            **PLACEMENT,
            "inference": {"resources": {"gpu_node": 0.2}},
            "replay": {"resources": {"gpu_node": 0.2}},
            "trainer": {"resources": {"gpu_node": 0.6}},
        }
    )
    cfg["replay"]["tables"][0].update(min_size_to_sample=500, samples_per_insert=32, error_buffer=20000)
    cfg["trainer"] = {
        "enabled": True,
        "nproc": 2,
        "min_nproc": 1,
        "shrink_after_s": 3.0,
        "batch_size": 64,
        "publish_every": 10,
        "checkpoint_every": 20,
        "eval_every": 0,
        "final_eval_episodes": 0,
        "max_updates": 1_000_000,
    }
    cfg["run"]["max_env_steps"] = 10_000_000
    run = tmp_path / "run"
    proc = up(cluster, write(tmp_path, cfg), run)
    lost = cluster.gpu
    try:
        wait_for(
            lambda: (run / "checkpoints" / "latest").exists() and env_steps(run) >= 1000,
            timeout=150,
            interval=0.2,
            what="the trainer's first checkpoint",
        )
        for service in ("inference-0", "replay", "trainer[0]", "trainer[1]"):
            assert [on(lost, n) for n in nodes_of(proc, service)] == [True], (service, placements(proc))
        on_lost = [f"worker-{i}" for i in range(2) if on(lost, nodes_of(proc, f"worker-{i}")[0])]
        assert len(on_lost) == 1, placements(proc)
        before = read_endpoints(run / "endpoints.json")
        spare = cluster.add(
            {**GPU_NODE, "resources": {"gpu_node": 1, "cpu_node": 1}, "node_ip_address": SPARE_IP}
        )
        cluster.remove(lost)
        cluster.gpu = spare
        steps_at_loss = env_steps(run)
        published_at_loss = published_versions(run)
        moved = ("inference-0", "replay", "trainer[0]", on_lost[0])
        wait_for(
            lambda: all(len(nodes_of(proc, name)) == 2 for name in moved),
            # Ray declares the node dead only after its health checks fail, later on a
            # busy machine: wait as long as pytest-timeout allows, less the run's end.
            timeout=time_left(margin=60),
            interval=0.2,
            what=f"{', '.join(moved)} to be placed again",
        )
        wait_for(
            lambda: resumed(run) and published_versions(run)[-1:] > published_at_loss[-1:],
            timeout=time_left(margin=45),
            interval=0.2,
            what="the resumed trainer's first publication",
        )
        # Stopped at once, a run whose collection was still held (the replay table's rate
        # limiter while the trainer came back) could end with no step after the loss.
        wait_for(
            lambda: env_steps(run) > steps_at_loss,
            timeout=time_left(margin=40),
            interval=0.2,
            what="collection to go on after the loss",
        )
    except BaseException:
        proc.kill()
        print(output(proc)[-8000:])  # the driver's placements and restarts, shown on failure
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    summary = finish(proc, run, outcome="interrupted")
    for name in ("inference-0", "replay", "trainer[0]"):
        assert on(spare, nodes_of(proc, name)[1]), (name, placements(proc))
    assert len(nodes_of(proc, "trainer[1]")) == 1, placements(proc)  # no second rank after the loss
    assert not on(lost, nodes_of(proc, on_lost[0])[1])
    log = output(proc)
    assert "inference-0 exited with signal SIGKILL; restart 1/" in log, log[-3000:]
    after = read_endpoints(run / "endpoints.json")
    for key, old_address in (
        (("inference", 0, "requests"), lookup(before, "inference", 0, "requests")),
        (("replay", "ingest"), lookup(before, "replay", "ingest")),
    ):
        new_address = lookup(after, *key)
        assert new_address == str(old_address).replace("127.0.0.1", SPARE_IP) != old_address, (key, after)
    gateway_log = (run / "logs" / "gateway.log").read_text()
    assert f"inference server 0 moved: {lookup(before, 'inference', 0, 'requests')}" in gateway_log
    assert f"replay ingest moved: {lookup(before, 'replay', 'ingest')}" in gateway_log
    replicas = [
        r["policy"]["replicas"]
        for r in read_metrics(run / "metrics.jsonl")
        if r.get("service") == "gateway" and "policy" in r
    ]
    assert replicas[-1][0]["address"] == lookup(after, "inference", 0, "requests")
    assert any(r[0]["address"] == replicas[-1][0]["address"] and r[0]["up"] for r in replicas)
    assert "trainer: no room for 2 ranks within 3 s; asking for 1 instead" in log, log[-3000:]
    assert "trainer: 1 ranks, rendezvous at" in log
    assert resumed(run), (run / "logs" / "trainer.log").read_text()[-3000:]
    assert summary["env_steps"] > steps_at_loss
    assert summary["acked_steps"] == summary["stored_steps"]
    assert summary["duplicate_steps"] == 0 and summary["lost_steps"] == 0
    records = read_metrics(run / "metrics.jsonl")
    seen = [r.get("trainer_version", 0) for r in records if r.get("service") == "gateway"]
    assert seen == sorted(seen), "the gateway saw a policy version go backwards"
    published = published_versions(run)
    assert published == sorted(published), "the resumed trainer published an older version"
    assert summary["policy_version"] == published[-1] >= max(seen)


def published_versions(run: Path) -> list[int]:
    records = read_metrics(run / "metrics.jsonl")
    return [int(r["version"]) for r in records if r.get("service") == "trainer" and "version" in r]


def resumed(run: Path) -> bool:
    """Whether the trainer's one-rank group, started after the loss, resumed from a checkpoint."""
    path = run / "logs" / "trainer.log"
    trainer_log = path.read_text() if path.exists() else ""
    start = trainer_log.find("process group: rank 0 of 1")
    return start >= 0 and "resumed from step-" in trainer_log[start:]


@pytest.mark.timeout(180)
def test_a_running_trainer_and_gateway_follow_the_replay_service_to_its_new_node(cluster, tmp_path):
    """The replay service runs on the robot host here (only so that its node can be lost
    alone: ``robot_arm0`` stands for nothing else in this test); the trainer (one rank, on
    the GPU node) and the gateway keep running. The node is removed and a new one with the
    same resource joins at an IP of its own (127.0.0.3): the replay service restarts there
    at a new address, the driver writes it into endpoints.json, and the running trainer
    samples from it and the running gateway delivers to it. The trainer is never
    restarted, its updates go on past the move (it saves a checkpoint after it), every
    acknowledged step is stored once. The run is then stopped (Ctrl-C): a trainer with an
    update budget could spend it before the node is removed, and nothing would move."""
    cfg = collection_config(
        placement={**PLACEMENT, "replay": {"num_cpus": 1, "resources": {"robot_arm0": 1}}},
    )
    cfg["policy"] = {"kind": "reach_pd"}
    del cfg["inference"]
    cfg["replay"]["tables"][0].update(min_size_to_sample=500, samples_per_insert=32, error_buffer=20000)
    cfg["trainer"] = {
        "enabled": True,
        "nproc": 1,
        "batch_size": 64,
        "publish_every": 10,
        "checkpoint_every": 20,
        "eval_every": 0,
        "final_eval_episodes": 0,
        "max_updates": 1_000_000,
    }
    cfg["run"]["max_env_steps"] = 10_000_000
    run = tmp_path / "run"
    proc = up(cluster, write(tmp_path, cfg), run)
    try:
        wait_for(
            lambda: (run / "checkpoints" / "latest").exists(),
            timeout=120,
            interval=0.2,
            what="the trainer's first checkpoint",
        )
        assert [on(cluster.robot, n) for n in nodes_of(proc, "replay")] == [True], placements(proc)
        before = lookup(read_endpoints(run / "endpoints.json"), "replay", "sample")
        cluster.remove(cluster.robot)
        cluster.robot = cluster.add({**ROBOT_HOST, "node_ip_address": "127.0.0.3"})
        wait_for(
            lambda: len(nodes_of(proc, "replay")) == 2,
            timeout=60,
            interval=0.2,
            what="the replay service placed on the new node",
        )
        wait_for(
            lambda: saved_after_move(run),
            timeout=time_left(margin=45),
            interval=0.2,
            what="a checkpoint the trainer saved after the replay service moved",
        )
    except BaseException:
        proc.kill()
        print(output(proc)[-8000:])  # the driver's placements and restarts, shown on failure
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    summary = finish(proc, run, outcome="interrupted")
    after = lookup(read_endpoints(run / "endpoints.json"), "replay", "sample")
    assert after == str(before).replace("127.0.0.1", "127.0.0.3") != before
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert f"replay service moved: {before} -> {after}" in trainer_log, trainer_log[-3000:]
    assert "replay ingest moved:" in (run / "logs" / "gateway.log").read_text()
    assert len(nodes_of(proc, "trainer")) == 1 and "trainer exited" not in output(proc)
    assert summary["acked_steps"] == summary["stored_steps"]
    assert summary["duplicate_steps"] == 0 and summary["lost_steps"] == 0


def saved_after_move(run: Path) -> bool:
    """Whether the trainer saved a checkpoint after it followed the replay service: it had
    updates to save, so it sampled from the service at its new address."""
    trainer_log = (run / "logs" / "trainer.log").read_text()
    moved = trainer_log.find("replay service moved:")
    return moved >= 0 and " saved (" in trainer_log[moved:]


@pytest.mark.timeout(180)
def test_a_robots_worker_is_only_ever_placed_on_its_robots_host(cluster, tmp_path):
    """worker-0 drives robot ``arm0`` (a MuJoCo arm stands in for the ROS 2 robot: the
    check is where Ray puts its process, which does not depend on the backend). It runs on
    the robot's host and nowhere else: when that host goes away the worker waits, though
    other nodes have room, and it comes back when a host of ``arm0`` joins again."""
    cfg = collection_config(
        workers=2,
        placement={
            **PLACEMENT,
            "worker-0": {"num_cpus": 1, "resources": {"robot_arm0": 1}, "labels": {"loopgate/host": "arm0"}},
        },
    )
    cfg["policy"] = {"kind": "reach_pd"}
    del cfg["inference"]
    run = tmp_path / "run"
    proc = up(cluster, write(tmp_path, cfg), run)
    try:
        wait_for(lambda: env_steps(run) >= 1000, timeout=90, interval=0.2, what="1000 env steps")
        assert [on(cluster.robot, n) for n in nodes_of(proc, "worker-0")] == [True], placements(proc)
        cluster.remove(cluster.robot)
        wait_for(
            lambda: service_states(run).get("worker-0") == "placing",
            timeout=60,
            interval=0.2,
            what="worker-0 to wait for its host",
        )
        time.sleep(5.0)  # room elsewhere all along: it must still be waiting
        assert service_states(run).get("worker-0") == "placing"
        assert len(nodes_of(proc, "worker-0")) == 1, placements(proc)
        cluster.robot = cluster.add(ROBOT_HOST)
        wait_for(
            lambda: len(nodes_of(proc, "worker-0")) == 2,
            timeout=60,
            interval=0.2,
            what="worker-0 placed on the robot's new host",
        )
        assert on(cluster.robot, nodes_of(proc, "worker-0")[1])
        wait_for(
            lambda: service_states(run).get("worker-0") == "running", timeout=60, what="worker-0 running"
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    summary = finish(proc, run, outcome="interrupted")
    assert summary["lost_steps"] == 0 and summary["duplicate_steps"] == 0


@pytest.mark.timeout(120)
def test_a_service_whose_node_stops_answering_is_lost_only_once_ray_declares_the_node_dead(cluster, tmp_path):
    """A node's processes are killed: the driver's connection to the service's actor closes
    at once (Ray calls the actor *unavailable*), seconds before Ray's health checks declare
    the node dead. Counted lost at the first of those, the service would be restarted while
    Ray's view still holds the lost node's room (and, were the node only slow, while the
    service still ran). The driver's handle reports the service lost only once Ray's node
    table no longer lists its node alive."""
    import ray

    from gateway.engines.ray_procs import LOST, RayProcess

    node = cluster.add({"num_cpus": 1, "resources": {"doomed": 1}})
    ray.init(address=cluster.address, log_to_driver=False, namespace="loopgate-test")
    try:
        proc = RayProcess(
            "sleeper",
            {"num_cpus": 0, "resources": {"doomed": 1}},
            [sys.executable, "-c", "import time; time.sleep(600)"],
            {},
            str(tmp_path / "sleeper.log"),
        )
        wait_for(lambda: proc.poll() is None and proc.pid is not None, timeout=60, what="the service started")
        cluster.remove(node)
        code = wait_for(
            lambda: proc.poll(), timeout=time_left(), interval=0.05, what="the service counted lost"
        )
        listed_alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert code == LOST
        assert node.node_id not in listed_alive, "counted lost while Ray still listed its node alive"
        proc.release()
    finally:
        ray.shutdown()


@pytest.mark.timeout(120)
def test_a_service_killed_outright_on_a_live_node_is_reported_killed_once_its_actor_answers(
    cluster, tmp_path, caplog
):
    """The other side of the test above: a Ray worker SIGKILLs its children on its way
    out when its node is lost, so the actor's report of its service killed outright is
    trusted only once the actor answers again. On a live node (an OOM kill, a ``kill -9``)
    it does, and the kill is reported as such, promptly."""
    import ray

    from gateway.engines.ray_procs import LOST, RayProcess

    ray.init(address=cluster.address, log_to_driver=False, namespace="loopgate-test")
    try:
        proc = RayProcess(
            "sleeper",
            {"num_cpus": 0},
            [sys.executable, "-c", "import time; time.sleep(600)"],
            {},
            str(tmp_path / "sleeper.log"),
        )
        wait_for(lambda: proc.poll() is None and proc.pid is not None, timeout=60, what="the service started")
        with caplog.at_level(logging.INFO, logger="loopgate.ray"):
            os.kill(proc.pid, signal.SIGKILL)
            code = wait_for(lambda: proc.poll(), timeout=time_left(), interval=0.05, what="the kill reported")
        assert code == LOST
        assert "waiting for its Ray actor to answer" in caplog.text
        assert "does not answer" not in caplog.text and "is gone" not in caplog.text
        proc.release()
    finally:
        ray.shutdown()


@pytest.mark.timeout(120)
def test_a_trainer_group_that_loses_its_node_before_its_ranks_start_is_placed_again(cluster, tmp_path):
    """The trainer's placement group is reserved on a node, which dies before the ranks are
    placed in it. Ray then places the group again, but only whole: on the node that joins
    instead, which has room for one rank, never. The ranks would wait forever (the
    fallback to fewer ranks is for groups that never found room), so the group is given
    up and asked for again, and after ``shrink_after_s`` its one-rank fallback starts on
    the new node."""
    import ray

    from gateway.engines.ray_procs import ref_ready
    from gateway.engines.ray_ranks import RankGroup

    first = cluster.add({"num_cpus": 2, "resources": {"ranks_here": 2}})
    ray.init(address=cluster.address, log_to_driver=False, namespace="loopgate-test")
    try:
        group = RankGroup(
            "trainer",
            [{"CPU": 1, "ranks_here": 1}] * 2,
            "PACK",
            [sys.executable, "-c", "import time; time.sleep(600)"],
            {},
            str(tmp_path / "trainer.log"),
            smaller=[1],
            shrink_after_s=2.0,
        )
        wait_for(lambda: ref_ready(group._pg_ready), timeout=60, what="the group reserved")  # not polled yet
        cluster.remove(first)
        second = cluster.add({"num_cpus": 2, "resources": {"ranks_here": 1}})
        wait_for(
            lambda: group.poll() is None and group.launched,
            timeout=time_left(),
            interval=0.1,
            what="the ranks started",
        )
        assert group.world_size == 1
        assert [r.node["node_id"] for r in group.ranks] == [second.node_id]  # type: ignore[index]
        group.release()
        cluster.remove(second)
    finally:
        ray.shutdown()
