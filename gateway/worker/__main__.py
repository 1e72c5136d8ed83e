"""``python -m gateway.worker``: see :mod:`gateway.worker.cli`."""

import sys

from gateway.worker.cli import main

sys.exit(main())
