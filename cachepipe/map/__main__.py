"""``python -m cachepipe.map SRC DST ...``: the ``map`` subcommand on its own."""

import sys

from .cli import main

sys.exit(main())
