"""The gateway's in-process policies refuse what they cannot act on, at start."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from gateway.episode import ActionSpec
from gateway.factory import experiment_spec
from gateway.policies import make_policy

pytestmark = pytest.mark.unit


def test_a_random_policy_on_unbounded_actions_is_refused_with_what_to_do() -> None:
    """Isaac Lab's action spaces are unbounded: sampling uniformly from them overflowed
    at the first step and the gateway restarted over and over."""
    base = experiment_spec("mujoco_reach")
    spec = dataclasses.replace(
        base, action=ActionSpec(dtype="float32", shape=(3,), low=-math.inf, high=math.inf)
    )
    with pytest.raises(ValueError, match=r"not finite.*clip_actions"):
        make_policy("random", spec, {}, seed=0)


def test_a_random_policy_samples_inside_finite_bounds() -> None:
    spec = experiment_spec("mujoco_reach")
    policy = make_policy("random", spec, {"scale": 0.5}, seed=0)
    obs = spec.zeros(64)
    action = policy.act(obs)
    assert action.shape == (64, *spec.action.shape) and action.dtype == np.dtype(spec.action.dtype)
    half = (spec.action.high_array - spec.action.low_array) / 4
    mid = (spec.action.high_array + spec.action.low_array) / 2
    assert (np.abs(action - mid) <= half + 1e-6).all()
