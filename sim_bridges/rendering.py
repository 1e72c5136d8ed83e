"""Headless MuJoCo rendering: choosing the OpenGL platform and rendering a batch of cameras.

MuJoCo picks its OpenGL platform from ``MUJOCO_GL`` once, when ``mujoco`` is first
imported, so the choice has to be made before that import. :func:`import_mujoco` does
both, and the MuJoCo bridges import ``mujoco`` only through it::

    mujoco = import_mujoco(rendering=True)    # sets MUJOCO_GL if the user did not
    camera = BatchCamera(mujoco, model, camera="top", height=84, width=84)
    images = camera.render(datas)             # uint8 [num_envs, 84, 84, 3]

The choice: a ``MUJOCO_GL`` set by the user always wins. Otherwise ``egl`` (headless,
and with Mesa a software renderer that needs no display or GPU), falling back to
``osmesa`` when EGL cannot initialise a display. Checking that EGL really initialises
loads the driver and costs about 0.2 s, so it runs only when rendering is asked for; an
import without rendering only checks that the libraries load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)
# PyOpenGL (loaded by MuJoCo's renderer) announces at INFO that its optional C
# accelerator is missing, in every process; that is not news to anyone.
logging.getLogger("OpenGL.acceleratesupport").setLevel(logging.WARNING)

INSTALL_HINT = (
    "install EGL with Mesa (`apt-get install libegl1 libgl1-mesa-dri`) or OSMesa "
    "(`apt-get install libosmesa6`, then run with MUJOCO_GL=osmesa)"
)

_EGL_PLATFORM_DEVICE_EXT = 0x313F
_OSMESA_RGBA = 0x1908
_chosen_by_us: str | None = None


class RenderingUnavailable(RuntimeError):
    """No headless OpenGL platform works; the message says what to install."""


def _load(names: tuple[str, ...]) -> ctypes.CDLL | None:
    for name in names:
        path = name if name.startswith("lib") else ctypes.util.find_library(name)
        if not path:
            continue
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _egl_works(initialise: bool) -> bool:
    """Whether EGL offers a device display (and, with ``initialise``, can open one)."""
    egl = _load(("libEGL.so.1", "EGL"))
    if egl is None:
        return False
    egl.eglGetProcAddress.restype = ctypes.c_void_p
    egl.eglGetProcAddress.argtypes = [ctypes.c_char_p]
    query_addr = egl.eglGetProcAddress(b"eglQueryDevicesEXT")
    display_addr = egl.eglGetProcAddress(b"eglGetPlatformDisplayEXT")
    if not query_addr or not display_addr:
        return False
    # MuJoCo's EGL context uses exactly these two extensions (headless device displays).
    query_devices = ctypes.CFUNCTYPE(
        ctypes.c_uint, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)
    )(query_addr)
    devices = (ctypes.c_void_p * 16)()
    count = ctypes.c_int(0)
    if not query_devices(16, devices, ctypes.byref(count)) or count.value < 1:
        return False
    if not initialise:
        return True
    get_display = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p)(
        display_addr
    )
    egl.eglInitialize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    egl.eglTerminate.argtypes = [ctypes.c_void_p]
    for i in range(count.value):
        display = get_display(_EGL_PLATFORM_DEVICE_EXT, devices[i], None)
        if display and egl.eglInitialize(display, None, None):
            egl.eglTerminate(display)
            return True
    return False


def _osmesa_works(initialise: bool) -> bool:
    osmesa = _load(("libOSMesa.so.8", "libOSMesa.so.6", "OSMesa"))
    if osmesa is None:
        return False
    if not initialise:
        return True
    osmesa.OSMesaCreateContextExt.restype = ctypes.c_void_p
    osmesa.OSMesaCreateContextExt.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p]
    osmesa.OSMesaDestroyContext.argtypes = [ctypes.c_void_p]
    context = osmesa.OSMesaCreateContextExt(_OSMESA_RGBA, 24, 8, 0, None)
    if not context:
        return False
    osmesa.OSMesaDestroyContext(context)
    return True


def select_gl_backend(*, check_context: bool = True) -> str | None:
    """Set ``MUJOCO_GL`` for headless rendering unless the user (or an earlier import) did.

    Returns the platform in effect (``None`` if none works). With ``check_context``
    EGL must initialise a display, not merely load, and finding no working platform
    raises :class:`RenderingUnavailable`. Must run before ``mujoco`` is imported to
    have any effect.
    """
    global _chosen_by_us
    current = os.environ.get("MUJOCO_GL")
    if (current is not None and _chosen_by_us is None) or "mujoco" in sys.modules:
        return current
    if _egl_works(initialise=check_context):
        choice: str | None = "egl"
    elif _osmesa_works(initialise=check_context):
        choice = "osmesa"
    else:
        choice = None
    if choice is None:
        if check_context:
            raise RenderingUnavailable(
                f"no headless OpenGL platform works (EGL cannot open a display and OSMesa is missing): {INSTALL_HINT}"
            )
        logger.info("no headless OpenGL platform found; cameras are unavailable (%s)", INSTALL_HINT)
        os.environ.pop("MUJOCO_GL", None)
    else:
        logger.debug("MUJOCO_GL=%s chosen for headless rendering", choice)
        os.environ["MUJOCO_GL"] = choice
    _chosen_by_us = choice
    return choice


def import_mujoco(*, rendering: bool) -> ModuleType:
    """``import mujoco``, having chosen ``MUJOCO_GL`` first (a full check when ``rendering``)."""
    if "mujoco" not in sys.modules:
        select_gl_backend(check_context=rendering)
    import mujoco

    module: ModuleType = mujoco
    return module


class BatchCamera:
    """One offscreen renderer that renders a named camera of many ``MjData`` in turn.

    The OpenGL context is created by :meth:`open` or the first :meth:`render`. Mesa's
    software renderer starts threads with its first context, and a process forked
    after that hangs when it renders; a camera that is built but not used yet (as in
    the throwaway env gymnasium's ``AsyncVectorEnv`` makes before forking) costs none.
    """

    def __init__(self, mujoco: ModuleType, model: Any, *, camera: str, height: int, width: int) -> None:
        # The offscreen framebuffer must hold the image; the model's default is 256x256 here.
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, width)
        model.vis.global_.offheight = max(model.vis.global_.offheight, height)
        self._mujoco = mujoco
        self._model = model
        self._camera = camera
        self.shape = (height, width, 3)
        self._renderer: Any = None
        self._closed = False

    def open(self) -> None:
        """Create the OpenGL context now, so that a missing platform fails here."""
        if self._renderer is not None:
            return
        if self._closed:
            raise RuntimeError("camera is closed")
        mujoco = self._mujoco
        height, width, _ = self.shape
        try:
            self._renderer = mujoco.Renderer(self._model, height=height, width=width)
        except (ImportError, RuntimeError, OSError, mujoco.FatalError) as exc:
            # Which of these arrives depends on the platform and how it failed; all of
            # them mean the same thing to the user.
            platform = os.environ.get("MUJOCO_GL")
            if platform is None:
                # mujoco was imported by someone else before a platform was chosen.
                hint = f"set MUJOCO_GL=egl (or osmesa) before Python starts; {INSTALL_HINT}"
            else:
                hint = INSTALL_HINT
            raise RenderingUnavailable(
                f"cannot create a headless OpenGL context (MUJOCO_GL={platform or '<unset>'}): {exc}; {hint}"
            ) from exc

    def render(self, datas: list[Any], out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
        """Images ``[len(datas), H, W, 3]`` of the camera in each data (kinematics must be current)."""
        self.open()
        if out is None:
            out = np.empty((len(datas), *self.shape), dtype=np.uint8)
        for i, data in enumerate(datas):
            self._renderer.update_scene(data, camera=self._camera)
            self._renderer.render(out=out[i])
        return out

    def close(self) -> None:
        renderer, self._renderer, self._closed = self._renderer, None, True
        if renderer is not None:
            renderer.close()
