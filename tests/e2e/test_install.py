"""A plain (non-editable) install serves from any directory: modes, policies and tasks ship as package data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import requests

from modeswitch.serving.launcher import ROOT, free_port


def test_a_non_editable_install_serves_the_demo_from_another_directory(tmp_path):
    # built from a copy: pip builds a local project in place, and the modeswitch.egg-info it would leave in the
    # checkout shadows the editable install's entry points (the vLLM plugin) for every process started there,
    # the test servers included
    source = tmp_path / "source"
    shutil.copytree(ROOT / "modeswitch", source / "modeswitch", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, timeout=300, cwd=tmp_path,
                   env={**os.environ, "PIP_NO_INPUT": "1"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "modeswitch", "--model", "demo", "--backend", "transformers",
                             "--modes", "fp16,prefix_cache", "--port", str(port)], cwd=elsewhere, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read()[-3000:])
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        modes = requests.get(url + "/v1/modes", timeout=10).json()
        assert modes["policy"]["source"].startswith(str(site)), modes["policy"]  # the shipped default policy
        assert modes["quality_gate"]["report"].startswith(str(site))  # the shipped demo gate report
        assert {m["name"]: m["status"] for m in modes["modes"]} == {"fp16": "available", "prefix_cache": "available"}
        body = requests.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                            "temperature": 0}, timeout=60).json()
        assert "Paris" in body["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
