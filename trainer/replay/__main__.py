"""``python -m trainer.replay``: the replay service (see :mod:`trainer.replay.cli`)."""

import sys

from trainer.replay.cli import main

sys.exit(main())
