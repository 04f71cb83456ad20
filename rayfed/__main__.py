"""``python -m rayfed``: the ``rayfed`` command."""

import sys

from rayfed.cli import main

sys.exit(main())
