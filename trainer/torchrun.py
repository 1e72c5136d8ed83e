"""``python -m trainer.torchrun ARGS``: torchrun (``torch.distributed.run``) that is told
once, not several times, that ``loopgate up`` is gone.

The kernel's parent-death signal comes once for every thread of the parent that exits,
so a supervisor that dies with several threads sends its children SIGTERM up to once a
thread. Most services shrug that off; torchrun does not: a second SIGTERM breaks off the
shutdown the first one began (its ranks' last words and checkpoint with it) and ends in
"forcefully exiting". This wrapper clears that signal and arms the lifeline's watcher
instead, which sends exactly one SIGTERM when the parent goes (and exits for sure after
a grace long enough for torchrun's own 30 s shutdown), then runs torchrun in this process.
"""

from __future__ import annotations

import runpy
import sys

from gateway import lifeline

MODULE = "torch.distributed.run"
GRACE_S = 40.0
"""torchrun's own shutdown waits up to 30 s for its ranks before it kills them."""


def main(argv: list[str] | None = None) -> None:
    lifeline.arm(GRACE_S, kernel_signal=False)
    sys.argv = [MODULE, *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
