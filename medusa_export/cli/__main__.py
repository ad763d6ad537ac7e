"""``python -m medusa_export.cli``: the ``medusa-export`` command."""

import sys

from .main import main

sys.exit(main())
