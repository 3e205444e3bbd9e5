"""``python -m modeswitch`` starts the server (same flags as serve.py)."""

import sys

from .server import main

sys.exit(main())
