"""``python -m modeswitch.testing [serve.py flags] [--fake-token-s S]``: the real server process (CLI,
waitress, signals, draining) over the fake backend, for tests of process behaviour that need no model."""

from __future__ import annotations

import argparse
import sys

from ..server import main
from .backend import FakeBackend
from .engine import Script

fake = argparse.ArgumentParser(add_help=False)
fake.add_argument("--fake-token-s", type=float, default=0.0, help="seconds between generated tokens, every mode")
ours, rest = fake.parse_known_args()
sys.exit(main(rest, backend=FakeBackend(default=Script(token_s=ours.fake_token_s))))
