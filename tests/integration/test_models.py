"""Weights resolution: the demo preset converts from the shipped GGUF; missing weights fail clearly."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT
from modeswitch.serving.launcher import free_port
from modeswitch.weights.presets import PRESETS, WeightsNotFound, local_or_hub, prepare_demo_checkpoint


def test_demo_checkpoint_is_a_real_llama_checkpoint():
    path = prepare_demo_checkpoint()
    assert (path / "config.json").is_file() and (path / "model.safetensors").stat().st_size > 100e6
    import json

    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30


def test_llama_preset_names_every_variant():
    p = PRESETS["llama-3.1-8b"]
    assert p.fp16 == "meta-llama/Llama-3.1-8B-Instruct"
    assert p.gptq and p.draft and p.w8a8


def test_missing_local_path_and_uncached_hub_id(monkeypatch, tmp_path):
    with pytest.raises(WeightsNotFound, match="no directory"):
        local_or_hub(str(tmp_path / "nothing-here"), "model x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsNotFound, match="no config.json"):
        local_or_hub(str(tmp_path / "empty"), "model x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(WeightsNotFound, match="huggingface-cli download meta-llama/Llama-3.1-8B-Instruct"):
        local_or_hub("meta-llama/Llama-3.1-8B-Instruct", "model llama-3.1-8b")


def test_serve_exits_nonzero_with_one_clear_line_when_weights_are_missing(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--model", "llama-3.1-8b", "--port", "1"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert "error: fp16 weights of llama-3.1-8b: meta-llama/Llama-3.1-8B-Instruct is not in the local" in out.stderr
    assert "Traceback" not in out.stderr


class _GatedHub(BaseHTTPRequestHandler):
    """Answers every file request as the hub does for a gated repo (401: not logged in, 403: licence not accepted)."""

    status = 401

    def do_HEAD(self):
        self.send_response(self.status)
        self.send_header("X-Error-Code", "GatedRepo")
        self.send_header("X-Error-Message", "Access to model meta-llama/Llama-3.1-8B-Instruct is restricted.")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("hub", ["refused", 401, 403])
def test_serve_exits_with_one_clear_line_when_the_hub_cannot_supply_the_weights(tmp_path, hub):
    """The flagship command without the weights, online: a hub that refuses connections, or one that answers
    as a gated repo does. Loopback only; no retries may hold the answer up."""
    if hub == "refused":
        endpoint, server = f"http://127.0.0.1:{free_port()}", None  # nothing listens there
    else:
        server = ThreadingHTTPServer(("127.0.0.1", 0), type("Hub", (_GatedHub,), {"status": hub}))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{server.server_port}"
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": endpoint, "PATH": "/usr/bin:/bin"}
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--model", "llama-3.1-8b", "--port", "1"],
                             capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    finally:
        if server is not None:
            server.shutdown()
    elapsed = time.monotonic() - started
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: fp16 weights of llama-3.1-8b: meta-llama/Llama-3.1-8B-Instruct"), out.stderr
    if hub == "refused":
        assert f"the hub ({endpoint}) cannot be reached" in errors[0]
    else:
        assert "gated model" in errors[0] and "huggingface-cli login" in errors[0]
    assert "huggingface-cli download meta-llama/Llama-3.1-8B-Instruct" in errors[0]
    assert elapsed < 20, f"{elapsed:.1f} s: the hub was retried"
