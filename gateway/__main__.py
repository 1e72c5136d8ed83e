"""``python -m gateway`` is the ``loopgate`` command."""

import sys

from gateway.cli import main

sys.exit(main())
