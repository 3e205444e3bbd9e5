"""Schemathesis over /openapi.json against a running server: no 5xx, every response matches the schema.

Run through schemathesis' own CLI (its pytest plugin does not support pytest 9 yet) against the real server
process over the fake backend (the schema, validation and error paths are the API's, whatever engine
serves): two modes, a 64-token context, so any request the fuzzer makes valid generates a few tokens at
most; examples are bounded per operation, so the run is bounded in time.

One check is left out, on purpose: ``positive_data_acceptance`` expects every schema-valid request to
succeed, but whether a prompt fits the context is counted in tokens, and whether a policy path exists is
known only at run time; those requests get a correct 400.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from modeswitch.serving.launcher import SERVE_FAKE, start_server


def test_schemathesis_finds_no_failures(tmp_path):
    proc, url, log = start_server(tmp_path, "--modes", "fp16,prefix_cache", "--fake-context", "64",
                                  "--max-inflight-per-client", "0", "--gate-report", "none", entry=SERVE_FAKE, wait_s=60)
    report = tmp_path / "schemathesis.json"
    cli = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    try:
        out = subprocess.run([cli, "run", url + "/openapi.json", "--max-examples", "40", "--generation-deterministic",
                              "--exclude-checks", "positive_data_acceptance", "--report", "json",
                              "--report-json-path", str(report)],
                             capture_output=True, text=True, timeout=900)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert out.returncode == 0, out.stdout[-6000:]
    result = json.loads(report.read_text())
    cases = result["test_cases"]
    print(f"fuzz: {cases['generated']} cases over {result['operations']['selected']} operations, "
          f"{cases['with_failures']} with failures, {len(result['errors'])} errors")
    assert result["failures"] == [] and result["errors"] == []
    assert cases["generated"] >= 200 and cases["with_failures"] == 0
    assert "Traceback" not in log.read_text()
