"""The canary for every touch of vLLM's internals (modeswitch.engines.vllm.compat): each symbol ModeSwitch replaces
or reads privately exists on the installed vLLM with the signature its replacement relies on; an untested vLLM is
refused with one line naming the range; a private read that finds nothing raises instead of reading as empty; the
per-request draft bound applies whatever container the sampled tokens come in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from modeswitch.engines.vllm import compat
from modeswitch.engines.vllm.drafting import bounded_drafts, sampled_rows
from modeswitch.engines.vllm.args import vllm_installed

needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")


@needs_vllm
@pytest.mark.parametrize("name", sorted(compat.TARGETS))
def test_every_target_is_there_as_checked(name):
    assert compat.TARGETS[name].problem() is None


@needs_vllm
def test_the_installed_vllm_is_in_the_tested_range_and_passes():
    assert compat.in_range(compat.installed_vllm(), compat.VLLM_TESTED)
    compat.require()


def test_a_changed_signature_or_a_missing_symbol_is_named():
    assert "takes (obj, skipkeys" in compat.Target("json", "dumps", ("value",)).problem()
    assert "json.nothing_here is missing" in compat.Target("json", "nothing_here", None).problem()
    assert "has no _private" in compat.Target("json", "JSONEncoder", None, ("_private",)).problem()
    assert compat.Target("json", "JSONEncoder.encode", ("o",)).problem() is None
    assert "is now" in compat.Target("json", "dumps", ("obj",), annotation=("obj", "list[int]")).problem()


def test_an_untested_version_is_refused_in_one_line_naming_the_range(monkeypatch):
    for version in ("0.31.2", "0.33.0", "1.0.0"):
        line = compat.version_problem(version, "2.13.0+cpu")
        assert line.startswith(f"vLLM {version} is untested") and ">=0.32.0,<0.33" in line and "\n" not in line
    assert compat.version_problem("0.32.0", "2.13.0+cpu") is None
    assert compat.version_problem("0.32.4", None) is None
    assert ">=2.13,<2.14" in compat.version_problem("0.32.0", "2.15.0")
    monkeypatch.setattr(compat, "installed_vllm", lambda: "0.34.1")
    with pytest.raises(compat.VllmIncompatible, match=r"^vLLM 0\.34\.1 is untested .*>=0\.32\.0,<0\.33"):
        compat.require()


def test_private_reads_fail_loudly():
    with pytest.raises(compat.VllmIncompatible, match="has no 'engine_core'"):
        compat.engine_processes(object())
    no_manager = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=None)))
    with pytest.raises(compat.VllmIncompatible, match="has no 'processes'"):
        compat.engine_processes(no_manager)
    with pytest.raises(compat.VllmIncompatible, match="has no 'shutdown'"):
        compat.engine_shutdown(SimpleNamespace(engine_core=SimpleNamespace()))
    procs = [SimpleNamespace(pid=7)]
    llm = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(
        engine_manager=SimpleNamespace(processes=procs))))
    assert compat.engine_processes(llm) == procs


def test_the_draft_bound_applies_to_lists_and_tensors_and_refuses_anything_else():
    """Row 0 may draft 1 token, row 1 none, row 2 as vLLM would; the proposer drafts 3 for every row it is given
    tokens for."""

    def propose(rows):
        return [[9, 9, 9] if ids else [] for ids in rows]

    limits = [1, 0, None]
    as_lists = [[5], [6], [7, 8]]
    padded = torch.tensor([[5, -1], [6, -1], [7, 8]])
    for sampled in (as_lists, padded):
        assert bounded_drafts(propose, limits, sampled_rows(sampled)) == [[9], [], [9, 9, 9]]
    assert sampled_rows(padded) == as_lists
    with pytest.raises(TypeError, match="cannot bound drafts"):
        sampled_rows({"not": "rows"})


@needs_vllm
def test_a_float32_engine_keeps_its_int8_linears_off_the_amx_kernel(monkeypatch):
    """On an AMX CPU vLLM sends W8A8 int8 linears to sgl-kernel's matmul, which takes 16-bit activations only: in a
    float32 engine (torch's default dtype while vLLM processes the weights) they go to oneDNN's instead."""
    import importlib

    from modeswitch.engines.vllm import plugin

    cpu = importlib.import_module(compat.TARGETS["cpu_sgl_check"].module)
    monkeypatch.setattr(compat, "_replaced", {})
    monkeypatch.setattr(cpu, "check_cpu_sgl_kernel", lambda n, k, dtype: True)  # as vLLM answers on an AMX CPU
    plugin.keep_int8_off_amx_in_float32()
    check = cpu.check_cpu_sgl_kernel
    assert check(64, 64, torch.int8) is False and check(64, 64, torch.bfloat16) is True
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        assert check(64, 64, torch.int8) is True
    finally:
        torch.set_default_dtype(default)
    plugin.keep_int8_off_amx_in_float32()
    assert cpu.check_cpu_sgl_kernel is check  # once
