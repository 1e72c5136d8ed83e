"""Process-level helpers shared by loopgate's long-running services."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

FROZEN = """
import gc, json
import numpy, zmq  # what a service has loaded by the time its loop starts
from gateway.services import freeze_heap

freeze_heap()
frozen = gc.get_freeze_count()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle made after the freeze
del a, b
print(json.dumps({"frozen": frozen, "collected": gc.collect()}))
"""


def test_freeze_heap_takes_startup_objects_out_of_collections_but_still_collects_new_garbage():
    """In a fresh interpreter: the modules loaded at start-up are frozen, and a cycle made
    afterwards is still found and freed."""
    import json

    out = subprocess.run(
        [sys.executable, "-c", FROZEN], capture_output=True, text=True, cwd=REPO, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    assert result["frozen"] > 10_000
    assert result["collected"] >= 2
