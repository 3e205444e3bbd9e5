"""Authentication and the admin routes: keys, confined reload paths, closed on an exposed bind, reloads that
switch routing and keep the old policy on a broken file (in-process, fake backend)."""

from __future__ import annotations

import pytest

KEY = "test-key-123"
BROKEN_FEATURE = """name: broken
rules:
  - name: oops
    when: {prompt_tokenz: {ge: 3}}
    use: fp16
default: fp16
"""


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_but_health_needs_the_key(make_app):
    app = make_app(api_key=KEY)
    assert app.get("/health").status_code == 200
    for method, path in [("get", "/v1/models"), ("get", "/v1/modes"), ("get", "/admin/policy"),
                         ("post", "/admin/policy"), ("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                         ("get", "/openapi.json"), ("get", "/metrics")]:
        for headers in ({}, auth("wrong"), {"Authorization": KEY}):
            resp = app.client.open(path, method=method.upper(), headers=headers, json={})
            assert resp.status_code == 401, (method, path, headers)
            assert resp.get_json()["error"]["code"] == "invalid_api_key"
    assert app.get("/v1/models", headers=auth()).status_code == 200
    assert app.get("/openapi.json", headers=auth()).get_json()["security"] == [{"bearer": []}]


@pytest.mark.parametrize("path", ["/etc/passwd", "../../../../etc/passwd", "/proc/self/environ"])
def test_admin_routes_never_open_files_outside_their_directories(make_app, path):
    app = make_app()
    for route in ("/admin/policy", "/admin/gate"):
        resp = app.post(route, json={"path": path})
        assert resp.status_code == 400, (route, path)
        err = resp.get_json()["error"]
        assert err["code"] == "path_not_allowed" and err["param"] == "path"
        assert "root:" not in err["message"] and "PATH=" not in err["message"]
    assert app.get("/admin/policy").get_json()["name"] == "test"


def test_a_valid_policy_outside_the_policy_directories_is_refused_unread(make_app, tmp_path):
    app = make_app()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "fp16.yaml").write_text("name: sneaky\nrules: []\ndefault: [fp16]\n")
    resp = app.post("/admin/policy", json={"path": str(elsewhere / "fp16.yaml")})
    assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "path_not_allowed"
    assert app.get("/admin/policy").get_json()["name"] == "test"
    # a directory the operator names (--admin-dir) is allowed
    opened = make_app(admin_dirs=[elsewhere])
    assert opened.post("/admin/policy", json={"path": str(elsewhere / "fp16.yaml")}).get_json()["name"] == "sneaky"


def test_reload_switches_routing_and_a_broken_policy_is_rejected(make_app):
    app = make_app()
    resp = app.post("/admin/policy", json={"path": "fp16.yaml"})  # a shipped policy, by name
    assert resp.status_code == 200 and resp.get_json()["name"] == "fp16"
    assert app.complete()["modeswitch"]["policy"] == "fp16"

    bad = app.policy_file.with_name("broken.yaml")  # beside the configured policy: allowed, and broken
    bad.write_text(BROKEN_FEATURE)
    err = app.post("/admin/policy", json={"path": str(bad)}).get_json()["error"]
    assert err["code"] == "invalid_policy"
    assert "broken.yaml:4" in err["message"] and "prompt_tokenz" in err["message"]
    assert app.get("/admin/policy").get_json()["name"] == "fp16"  # the old policy stays

    missing = app.post("/admin/policy", json={"path": str(app.policy_file.with_name("nope.yaml"))})
    assert missing.status_code == 400 and "cannot read" in missing.get_json()["error"]["message"]

    resp = app.post("/admin/policy", json={"path": str(app.policy_file)})
    assert resp.status_code == 200 and app.get("/admin/policy").get_json()["name"] == "test"


def test_admin_routes_are_closed_on_an_exposed_bind_without_a_key(make_app):
    exposed = make_app(host="0.0.0.0")
    for method, path in [("GET", "/admin/policy"), ("POST", "/admin/policy"), ("POST", "/admin/gate")]:
        resp = exposed.client.open(path, method=method, json={})
        assert resp.status_code == 403 and resp.get_json()["error"]["code"] == "admin_disabled", path
    assert exposed.complete()["choices"]  # serving itself is unaffected
    assert make_app(host="0.0.0.0", unauthenticated_admin=True).get("/admin/policy").status_code == 200
    assert make_app(host="0.0.0.0", api_key=KEY).get("/admin/policy", headers=auth()).status_code == 200
    assert make_app(host="::1").get("/admin/policy").status_code == 200
