"""Waiting in a test for a state the server reaches on its own time: poll it, never sleep a fixed guess."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, every: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true, and return that; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)
    return value
