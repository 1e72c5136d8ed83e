"""Choosing MuJoCo's headless OpenGL platform (no rendering happens here)."""

from __future__ import annotations

import os
import sys

import pytest

from sim_bridges import rendering

pytestmark = pytest.mark.unit


@pytest.fixture
def before_mujoco_import(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A process state in which mujoco is not imported yet and MUJOCO_GL is unset (all restored after)."""
    monkeypatch.delitem(sys.modules, "mujoco", raising=False)
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    monkeypatch.setattr(rendering, "_chosen_by_us", None)
    return monkeypatch


def _probe(result: bool) -> object:
    return lambda initialise: result


def test_egl_is_preferred(before_mujoco_import: pytest.MonkeyPatch) -> None:
    before_mujoco_import.setattr(rendering, "_egl_works", _probe(True))
    before_mujoco_import.setattr(rendering, "_osmesa_works", _probe(True))
    assert rendering.select_gl_backend() == "egl"
    assert os.environ["MUJOCO_GL"] == "egl"


def test_osmesa_is_the_fallback_when_egl_cannot_open_a_display(
    before_mujoco_import: pytest.MonkeyPatch,
) -> None:
    before_mujoco_import.setattr(rendering, "_egl_works", _probe(False))
    before_mujoco_import.setattr(rendering, "_osmesa_works", _probe(True))
    assert rendering.select_gl_backend() == "osmesa"
    assert os.environ["MUJOCO_GL"] == "osmesa"


def test_user_choice_is_respected_without_probing(before_mujoco_import: pytest.MonkeyPatch) -> None:
    def fail(initialise: bool) -> bool:
        raise AssertionError("probed although MUJOCO_GL was set")

    before_mujoco_import.setenv("MUJOCO_GL", "osmesa")
    before_mujoco_import.setattr(rendering, "_egl_works", fail)
    assert rendering.select_gl_backend() == "osmesa"


def test_no_platform_names_the_packages_to_install(before_mujoco_import: pytest.MonkeyPatch) -> None:
    before_mujoco_import.setattr(rendering, "_egl_works", _probe(False))
    before_mujoco_import.setattr(rendering, "_osmesa_works", _probe(False))
    with pytest.raises(rendering.RenderingUnavailable, match=r"libegl1 libgl1-mesa-dri.*libosmesa6"):
        rendering.select_gl_backend(check_context=True)
    # Without rendering asked for, a missing platform is not an error: MuJoCo still simulates.
    assert rendering.select_gl_backend(check_context=False) is None
    assert "MUJOCO_GL" not in os.environ


def test_this_machine_has_a_working_platform() -> None:
    assert rendering._egl_works(initialise=True) or rendering._osmesa_works(initialise=True)
