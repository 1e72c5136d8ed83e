"""``python -m gateway.inference``: one inference server (see :mod:`gateway.inference.server`)."""

import sys

from gateway.inference.server import main

sys.exit(main())
