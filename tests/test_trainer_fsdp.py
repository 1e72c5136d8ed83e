"""FSDP2 over real gloo process groups: checkpoints load across world sizes (2 -> 1, 1 -> 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration
SCRIPT = REPO / "tests" / "scripts" / "fsdp_checkpoint.py"


def run_script(script, *args, nproc: int = 1) -> None:
    """``script ARGS``: under torchrun with ``nproc`` ranks, or alone (1)."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    )
    run = subprocess.run(
        [sys.executable, *launcher, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]


def same_state(saved, loaded) -> tuple[dict, dict]:
    """Both runs' results, asserted to hold the same counters and state."""
    a, b = json.loads(saved.read_text()), json.loads(loaded.read_text())
    assert b["counters"] == a["counters"]
    assert a["actor"] == pytest.approx(b["actor"], rel=1e-6)
    assert a["critic"] == pytest.approx(b["critic"], rel=1e-6)
    assert a["log_alpha"] == pytest.approx(b["log_alpha"], rel=1e-6)
    return a, b


def test_two_process_checkpoint_resumes_in_one_process_with_the_same_state(tmp_path):
    saved, loaded = tmp_path / "saved.json", tmp_path / "loaded.json"
    run_script(SCRIPT, "save", tmp_path / "ck", saved, nproc=2)
    run_script(SCRIPT, "load", tmp_path / "ck", loaded)
    a, b = same_state(saved, loaded)
    assert (a["world"], b["world"]) == (2, 1)
    assert (a["sharded"], b["sharded"]) == (True, False)  # one CPU process: plain modules
    assert b["counters"] == {"updates": 4, "version": 7, "samples": 256}


def test_one_process_checkpoint_resumes_in_two_processes_with_the_same_state(tmp_path):
    """A trainer that ran alone (plain modules, no FSDP on one CPU process) and is
    restarted with ``trainer.nproc: 2`` resumes sharded, with the same state."""
    saved, loaded = tmp_path / "saved.json", tmp_path / "loaded.json"
    run_script(SCRIPT, "save", tmp_path / "ck", saved)
    run_script(SCRIPT, "load", tmp_path / "ck", loaded, nproc=2)
    a, b = same_state(saved, loaded)
    assert (a["world"], b["world"]) == (1, 2)
    assert (a["sharded"], b["sharded"]) == (False, True)
    assert b["counters"] == {"updates": 4, "version": 7, "samples": 128}


def test_a_group_of_one_snapshots_its_own_state_dict_with_dcp_names_and_values(tmp_path):
    """In a group of one the publication's snapshot skips DCP's gather and reads each
    shard (the whole tensor) or plain parameter directly; a module whose own names differ from DCP's (a
    compiled one: ``_orig_mod.``) still goes through DCP, so published names never change."""
    out = tmp_path / "snapshot.json"
    run_script(REPO / "tests" / "scripts" / "one_rank_snapshot.py", out)
    result = json.loads(out.read_text())
    assert result["world"] == 1
    sharded, plain, compiled = result["sharded"], result["plain"], result["compiled"]
    assert sharded["local_path"] is True and plain["local_path"] is True
    assert compiled["local_path"] is False
    for case in (sharded, plain, compiled):
        assert case["names"] == case["dcp_names"] and case["names"]
        assert case["equal"] and case["reused"] and not case["aliased"]
    assert not any(name.startswith("_orig_mod") for name in compiled["names"])
