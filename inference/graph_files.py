"""Where onnxruntime reads graphs from: files that go when the serving process goes."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import numpy as np


class GraphFiles:
    """Files onnxruntime loads graphs from, gone when this process ends however it ends.

    On Linux each graph is an anonymous in-memory file (``memfd_create``) opened through
    ``/proc/self/fd``: nothing is left in the temp folder after a SIGKILL or a crash,
    which would otherwise keep a copy of the model per run. Elsewhere: a temp folder,
    removed when the backend is collected or the interpreter exits.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._dir = ""
        if not hasattr(os, "memfd_create"):
            self._dir = tempfile.mkdtemp(prefix="loopgate-inference-")
            weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        weakref.finalize(self, _close_all, self._fds)

    def write(self, blob: bytes | np.ndarray, name: str) -> str:
        """A path that opens to ``blob``."""
        data = blob if isinstance(blob, bytes) else blob.data
        if self._dir:
            path = os.path.join(self._dir, name)
            with open(path, "wb") as f:
                f.write(data)
            return path
        fd = os.memfd_create(f"loopgate-{name}", os.MFD_CLOEXEC)
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        path = f"/proc/self/fd/{fd}"
        self._fds[path] = fd
        return path

    def remove(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)
        elif path:
            os.unlink(path)


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
