"""What every route of the HTTP layer reads: the service, admission control and the server's configuration.

The app holds one :class:`ApiContext` (``app.extensions``); blueprints reach it through :func:`ctx`, so
routes are plain functions in modules of their own instead of closures inside one factory.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from pathlib import Path

from flask import current_app

from ..config import HttpConfig
from ..serving.admission import Admission
from ..serving.service import Service

EXTENSION = "modeswitch"


@dataclass(frozen=True)
class ApiContext:
    service: Service
    admission: Admission
    http: HttpConfig
    #: directories ``POST /admin/policy`` may load policy files from (never anything else on disk)
    policy_dirs: tuple[Path, ...] = ()
    #: directories ``POST /admin/gate`` may load gate reports from
    report_dirs: tuple[Path, ...] = ()
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def admin_exposed(self) -> bool:
        """Admin routes would be open to the network: a non-loopback bind without an API key."""
        return not self.http.api_key and not is_loopback(self.http.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        return False


def ctx() -> ApiContext:
    return current_app.extensions[EXTENSION]
