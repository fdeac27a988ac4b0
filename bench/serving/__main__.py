"""``python -m bench.serving``: see ``bench.serving.cli``."""

import sys

from bench.serving.cli import main

sys.exit(main())
