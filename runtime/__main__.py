"""``python -m medusa_runtime generate|chat --artifact DIR`` (torch-free)."""

import sys

from .front.cli import main

sys.exit(main())
