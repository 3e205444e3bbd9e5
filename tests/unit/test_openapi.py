"""The published schema and the app's routes stay in sync (the fuzz test checks the responses)."""

from __future__ import annotations

from modeswitch.serving.admission import Admission
from modeswitch.api.app import create_app
from modeswitch.api.context import ApiContext
from modeswitch.api.openapi import build_spec
from modeswitch.config import HttpConfig


def test_every_route_is_documented_with_its_methods_and_nothing_else():
    # routes only touch the service when called
    app = create_app(ApiContext(service=None, admission=Admission(0), http=HttpConfig()))
    routes = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint != "static":
            routes.setdefault(rule.rule, set()).update(m.lower() for m in rule.methods - {"HEAD", "OPTIONS"})
    spec = build_spec(auth=False)
    assert {path: set(ops) for path, ops in spec["paths"].items()} == routes
    body = spec["components"]["schemas"]["CompletionBody"]
    assert {"prompt", "max_tokens", "temperature", "stream", "mode"} <= set(body["properties"])
    assert "security" not in spec and build_spec(auth=True)["security"] == [{"bearer": []}]
