"""Experiment configs: loading, overrides, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, from_dict, load_config, parse_override
from tests.conftest import loopgate

pytestmark = pytest.mark.unit
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_reach_sim_loads_with_every_block():
    cfg = load_config(CONFIGS / "reach_sim.yaml")
    assert cfg.env.backend == "mujoco_reach" and cfg.name == "reach_sim"
    for block in ("env", "policy", "gateway", "run"):
        assert cfg.has(block)


def test_overrides_address_block_dot_key_and_parse_yaml_values():
    cfg = load_config(
        CONFIGS / "reach_sim.yaml",
        ["env.num_envs=3", "gateway.limits.max_frames=64", "env.options.camera=true"],
    )
    assert cfg.env.num_envs == 3
    assert cfg.gateway.limits.max_frames == 64
    assert cfg.env.options["camera"] is True


def test_round_trip_through_dump(tmp_path):
    cfg = load_config(CONFIGS / "reach_sim.yaml")
    cfg.dump(tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"env": {"num_envs": 0}}, "env.num_envs"),
        ({"env": {"num_envs": "four"}}, "env.num_envs"),
        ({"env": {"backend": "nope"}}, "env.backend"),
        ({"env": {"colour": 3}}, "env: unknown key(s) colour"),
        ({"policy": {"kind": "clever"}}, "policy.kind"),
        ({"gateway": {"transport": "udp"}}, "gateway.transport"),
        ({"gateway": {"worker_port": 70000}}, "gateway.worker_port"),
        ({"gateway": {"host": "0.0.0.0"}}, "gateway.curve_keys"),
        ({"gateway": {"limits": {"max_frames": -1}}}, "max_frames"),
        ({"run": {"max_env_steps": 0}}, "run.max_env_steps"),
        ({"run": {"log_level": "LOUD"}}, "run.log_level"),
        ({"mystery": {}}, "unknown config block(s) mystery"),
        ({"env": {"options": {"succes_radius": 0.1}}}, "env.options"),
        ({"env": {"options": {"success_radius": -1.0}}}, "env.options.success_radius"),
        ({"env": ["not", "a", "map"]}, "env: must be a mapping"),
        ({"trainer": {"batch_size": -1}}, "trainer.batch_size must be >= 1, got -1"),
        ({"policy": {"kind": "reach_pd", "options": {"gian": 2.0}}}, "policy.options: unknown key(s) gian"),
        ({"policy": {"kind": "random", "options": {"scale": 2.0}}}, "policy.options"),
        ({"policy": {"kind": "external", "options": {"gain": 1}}}, "policy.kind 'external' takes no options"),
        ({"trainer": {"eval_every": -5}}, "trainer.eval_every must be >= 0 (0: no periodic evaluation)"),
        ({"inference": {"max_wait_us": -1}}, "inference.max_wait_us must be >= 0, got -1"),
        ({"inference": {"max_wait_us": "long"}}, "inference.max_wait_us"),
    ],
)
def test_invalid_config_names_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        from_dict(data)
    assert field in str(info.value)


def test_an_unset_batch_wait_depends_on_where_the_server_runs():
    """Null: a GPU server waits 500 us for a batch's company, a CPU server none; a value
    set in the config (or with --set) holds on both."""
    unset = load_config(CONFIGS / "reach_sim.yaml").inference
    assert unset.max_wait_us is None
    assert (unset.max_wait_on("cpu"), unset.max_wait_on("cuda:0"), unset.max_wait_on("cuda")) == (0, 500, 500)
    set_ = load_config(CONFIGS / "reach_sim.yaml", ["inference.max_wait_us=300"]).inference
    assert (set_.max_wait_on("cpu"), set_.max_wait_on("cuda:1")) == (300, 300)
    zero = load_config(CONFIGS / "reach_sim.yaml", ["inference.max_wait_us=0"]).inference
    assert zero.max_wait_on("cuda:0") == 0


def test_bad_override_syntax_is_explained():
    with pytest.raises(ConfigError, match=r"block\.key=value"):
        parse_override("num_envs")
    with pytest.raises(ConfigError, match="must name a block and a field"):
        parse_override("env=3")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a folder; give a YAML file"):
        load_config(tmp_path)  # said "does not exist" of a folder that does
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_gymnasiums_own_mujoco_tasks_build_out_of_the_box():
    """``gymnasium[mujoco]`` is a dependency: Reacher-v5 renders through imageio."""
    from gateway.factory import experiment_spec

    spec = experiment_spec("gymnasium", {"id": "Reacher-v5"})
    assert spec.action.shape == (2,)


def test_a_backend_that_cannot_be_imported_is_one_line_naming_the_env_and_the_package(tmp_path):
    path = tmp_path / "missing.yaml"
    path.write_text(
        "env: {backend: gymnasium, options: {id: 'no_such_sim_pkg.envs:Arm-v0'}}\npolicy: {kind: random}\n"
    )
    out = loopgate("up", str(path), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "no_such_sim_pkg.envs:Arm-v0" in errors[0] and "'no_such_sim_pkg'" in errors[0]
    assert "pip install no_such_sim_pkg" in errors[0]
    assert not (tmp_path / "run" / "endpoints.json").exists()  # refused before anything started
