"""``python -m inference``: one inference server (see :mod:`inference.server`)."""

import sys

from inference.server import main

sys.exit(main())
