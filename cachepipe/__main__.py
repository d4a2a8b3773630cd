"""``python -m cachepipe``: the ``cachepipe`` command (see :mod:`cachepipe.cli`)."""

from .cli import main

raise SystemExit(main())
