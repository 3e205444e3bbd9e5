"""The command line is derived from the configuration dataclasses (modeswitch.config): one place for every
default. ``serve.py --help`` as a user runs it, and the parsed flags, against the dataclasses' own defaults."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from modeswitch.cluster.app import ClusterConfig, cluster_parser, config_from_cluster_args
from modeswitch.config import API_KEY_ENV, HttpConfig, LoadConfig, ServerConfig
from modeswitch.serving.launcher import ROOT
from modeswitch.server import build_parser, config_from_args


def flags_of(cls: type) -> list[tuple[str, object]]:
    return [(f.metadata["flag"] or "--" + f.name.replace("_", "-"), f.default)
            for f in dataclasses.fields(cls) if "help" in f.metadata]


def help_entries(text: str) -> dict[str, str]:
    """``--help`` output -> each option's first flag -> its entry (flag, metavar and help, on one line)."""
    entries: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if re.match(r"  --[a-z]", line):
            current = line.split()[0].rstrip(",")
            entries[current] = []
        elif not line.strip() or not line.startswith("   "):
            current = None
        if current:
            entries[current].append(line.strip())
    return {flag: " ".join(lines) for flag, lines in entries.items()}


def test_serve_help_states_every_config_default():
    """Every user-settable field of the three sections has its flag in ``serve.py --help`` as a user runs it,
    stating the dataclass's default."""
    out = subprocess.run([sys.executable, "serve.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    entries = help_entries(out.stdout)
    flags = flags_of(ServerConfig) + flags_of(LoadConfig) + flags_of(HttpConfig)
    assert len(flags) >= 20
    for flag, default in flags:
        assert flag in entries, f"{flag} missing from --help"
        stated = re.findall(r"\(default: ([^)]*)\)", entries[flag])
        if default not in (None, ()):  # a None default's help says in words what it means
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
            assert stated == [shown], (flag, stated, default)


def test_no_flags_give_the_default_config(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert config_from_args(build_parser().parse_args([])) == ServerConfig()
    cluster = config_from_cluster_args(cluster_parser().parse_args([]))
    assert cluster == ClusterConfig(server=ServerConfig())


def test_flags_reach_their_fields(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    config = config_from_args(build_parser().parse_args([
        "--modes", "fp16, int8", "--modes-dir", "a", "--modes-dir", "b", "--memory-budget", "2GiB",
        "--no-staged-start", "--port", "9", "--policy", "p.yaml", "--backend", "transformers", "--drain-timeout", "5"]))
    assert config.modes == ("fp16", "int8")
    assert [str(d) for d in config.modes_dirs] == ["a", "b"] and str(config.policy) == "p.yaml"
    assert config.load == LoadConfig(backend="transformers", memory_budget=2 * 2**30, staged=False)
    assert config.http == HttpConfig(port=9, drain_timeout=5.0, api_key="from-env")  # the key from the environment
    assert config_from_args(build_parser().parse_args(["--api-key", "flag"])).http.api_key == "flag"
    # loading everything before exiting: no staged start, whatever the flag says
    assert config_from_args(build_parser().parse_args(["--exit-when-ready"])).load.staged is False
    cluster = config_from_cluster_args(cluster_parser().parse_args(["--replicas", "3", "--replica-cpus", "1.5"]))
    assert (cluster.replicas, cluster.num_cpus, cluster.router) == (3, 1.5, "modeswitch")


@pytest.mark.parametrize("argv, message", [
    (["--memory-budget", "12XB"], "argument --memory-budget: not a memory size: '12XB'"),
    (["--backend", "onnx"], "argument --backend: invalid choice: 'onnx'"),
    (["--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
