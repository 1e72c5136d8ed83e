"""FSDP2 over real gloo process groups: a 2-process checkpoint loads into 1 process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration
SCRIPT = REPO / "tests" / "scripts" / "fsdp_checkpoint.py"


def test_two_process_checkpoint_resumes_in_one_process_with_the_same_state(tmp_path):
    saved, loaded = tmp_path / "saved.json", tmp_path / "loaded.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPT),
            "save",
            str(tmp_path / "ck"),
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "load", str(tmp_path / "ck"), str(loaded)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = json.loads(saved.read_text()), json.loads(loaded.read_text())
    assert (a["world"], b["world"]) == (2, 1)
    assert b["counters"] == {"updates": 4, "version": 7, "samples": 256}
    assert a["actor"] == pytest.approx(b["actor"], rel=1e-6)
    assert a["critic"] == pytest.approx(b["critic"], rel=1e-6)
    assert a["log_alpha"] == pytest.approx(b["log_alpha"], rel=1e-6)


def test_a_group_of_one_snapshots_its_own_state_dict_with_dcp_names_and_values(tmp_path):
    """In a group of one the publication's snapshot skips DCP's gather and reads each
    shard (the whole tensor) directly; a module whose own names differ from DCP's (a
    compiled one: ``_orig_mod.``) still goes through DCP, so published names never change."""
    out = tmp_path / "snapshot.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "scripts" / "one_rank_snapshot.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 1
    actor, compiled = result["actor"], result["compiled"]
    assert actor["local_path"] is True and compiled["local_path"] is False
    for case in (actor, compiled):
        assert case["names"] == case["dcp_names"] and case["names"]
        assert case["equal"] and case["reused"] and not case["aliased"]
    assert not any(name.startswith("_orig_mod") for name in compiled["names"])
