"""``python -m modeswitch.testing [serve.py flags] [--fake-token-s S] [--fake-context N]``: the real server process (CLI,
waitress, signals, draining) over the fake backend, for tests of process behaviour that need no model."""

from __future__ import annotations

import argparse
import sys

from ..server import main
from .backend import FakeBackend
from .engine import Script

fake = argparse.ArgumentParser(add_help=False)
fake.add_argument("--fake-token-s", type=float, default=0.0, help="seconds between generated tokens, every mode")
fake.add_argument("--fake-context", type=int, default=2048, help="the fake model's context in (byte) tokens")
ours, rest = fake.parse_known_args()
backend = FakeBackend(default=Script(token_s=ours.fake_token_s), context_length=ours.fake_context)
sys.exit(main(rest, backend=backend))
