"""Policies reload without restart (HTTP and SIGHUP); a broken file is rejected and the old policy keeps routing."""

from __future__ import annotations

import time

from conftest import ROOT

BROKEN_FEATURE = """name: broken
rules:
  - name: oops
    when: {prompt_tokenz: {ge: 3}}
    use: fp16
default: fp16
"""


def current(server) -> str:
    return server.get("/admin/policy").json()["name"]


def routed_mode(server) -> dict:
    return server.complete("Tell me a story", max_tokens=2)["modeswitch"]


def test_reload_switches_routing_and_broken_policy_is_rejected(server):
    original = server.policy_file.read_text()
    try:
        resp = server.post("/admin/policy", json={"path": str(ROOT / "policies" / "fp16.yaml")})
        assert resp.status_code == 200, resp.text
        assert resp.json()["name"] == "fp16"
        info = routed_mode(server)
        assert info["mode"] == "fp16" and info["policy"] == "fp16"

        bad = server.policy_file.with_name("broken.yaml")
        bad.write_text(BROKEN_FEATURE)
        resp = server.post("/admin/policy", json={"path": str(bad)})
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["code"] == "invalid_policy"
        assert "broken.yaml:4" in err["message"] and "prompt_tokenz" in err["message"]
        assert current(server) == "fp16"  # the old policy stays
        assert routed_mode(server)["mode"] == "fp16"

        missing = server.post("/admin/policy", json={"path": "/no/such/policy.yaml"})
        assert missing.status_code == 400 and "cannot read" in missing.json()["error"]["message"]

        resp = server.post("/admin/policy", json={"path": str(server.policy_file)})
        assert resp.status_code == 200 and current(server) == "paper"
    finally:
        server.policy_file.write_text(original)
        server.post("/admin/policy", json={"path": str(server.policy_file)})


def wait_for_policy(server, name: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if current(server) == name:
            return True
        time.sleep(0.1)
    return False


def test_sighup_reloads_the_policy_file_and_keeps_the_old_one_when_broken(server):
    original = server.policy_file.read_text()
    try:
        server.policy_file.write_text("name: hup\nrules: []\ndefault: [speculative]\nfallback: [fp16]\n")
        server.sighup()
        assert wait_for_policy(server, "hup")
        assert routed_mode(server)["mode"] == "speculative"

        server.policy_file.write_text("name: hup2\nrules: [\n")  # invalid YAML
        server.sighup()
        time.sleep(1)
        assert current(server) == "hup"
        assert "policy not changed" in server.log_file.read_text()
    finally:
        server.policy_file.write_text(original)
        server.sighup()
        assert wait_for_policy(server, "paper")
