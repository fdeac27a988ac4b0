"""``python -m m3stack`` is the ``m3stack`` command."""

import sys

from m3stack.cli import main

sys.exit(main())
