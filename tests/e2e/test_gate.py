"""The quality gate: the lm-eval adapter, the gate report end to end, and the router enforcing it.

The degraded mode is defined only here: the demo's weights with Gaussian noise (half of each matrix's
standard deviation) on every decoder projection, served as the 'gptq' weights variant of a test mode.
"""

from __future__ import annotations

import json
import shutil

import pytest
import requests
import torch

from conftest import ROOT
from modeswitch.device import cpu_has_bf16
from modeswitch.evals.gate import run_gate, write
from modeswitch.evals.run import evaluate
from modeswitch.serving.launcher import start_server
from modeswitch.weights.presets import prepare_demo_checkpoint, prepare_demo_gptq


@pytest.fixture(scope="module")
def degraded_dir(tmp_path_factory):
    """A real GPTQ 4-bit checkpoint of worse quality: the demo's, with every group's scale scattered by noise.
    Its linears are still int4 (a mode on it is what its name says), its answers are not the reference's."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("degraded") / "SmolLM2-gptq-noisy"
    shutil.copytree(prepare_demo_gptq(), out)
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith(".scales"):
            tensors[name] = (t.float() * (1 + 0.5 * torch.randn(t.shape, generator=gen))).to(t.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def ours():
    """The adapter's results on fp16 (both kinds of task), which the next two tests compare with lm-eval's own
    models: computed once (scoring 80 choices and generating 20 answers takes 25 s on 2 cores)."""
    return evaluate("modeswitch", tasks=("jargon_cloze", "jargon_copy"), limit=20,
                    model_args="model=demo,mode=fp16,dtype=float32")["results"]


def test_adapter_scores_like_lm_evals_hf_model_and_above_chance(ours):
    hf = evaluate("hf", tasks=("jargon_cloze",), limit=20,
                  model_args=f"pretrained={prepare_demo_checkpoint()},dtype=float32,device=cpu")
    acc = ours["jargon_cloze"]["acc,none"]
    assert acc == hf["results"]["jargon_cloze"]["acc,none"]
    assert acc >= 0.6  # chance is 0.25 (12 of 20 by chance: p < 0.001): the task measures something here


def test_a_mode_that_cannot_score_is_scored_on_its_weights_through_the_engine():
    """transformers' continuous batching cannot return prompt logprobs: its weights are scored by a plain mode
    on the same weights, through the engine's scoring path, and agree with a forward pass of those weights."""
    from modeswitch.evals.adapter import ModeSwitchLM

    lm = ModeSwitchLM(model="demo", mode="continuous_batching", engine="transformers", max_length=256, dtype="float32")
    try:
        assert (lm.backend, lm.scored_on) == ("transformers", "score-fp16")
        context, continuation = lm.tok_encode("The hacker ethic holds that"), lm.tok_encode(" information")
        scorer = lm.registry.modes["score-fp16"].engine
        served_before = scorer.stats()["requests"]
        (total, greedy), = lm._loglikelihood_tokens([(None, context, continuation)])
        weights = lm.registry.backend.weights.models["fp16"]
        with torch.no_grad():
            logits = weights(torch.tensor([context + continuation[:-1]])).logits[0, -len(continuation):]
        expected = torch.log_softmax(logits.float(), -1)[range(len(continuation)), continuation].sum().item()
        assert total == pytest.approx(expected, abs=1e-3) and total < 0
        assert greedy == bool((logits.argmax(-1) == torch.tensor(continuation)).all())
        assert scorer.stats()["requests"] == served_before + 1
    finally:
        lm.registry.close()


def test_gate_report_is_enforced_and_reloadable(tmp_path, degraded_dir):
    modes = tmp_path / "modes"
    modes.mkdir()
    for name in ("fp16", "prefix_cache"):
        shutil.copy(ROOT / "modes" / f"{name}.yaml", modes)
    (modes / "degraded.yaml").write_text("name: degraded\nweights: gptq\ndescription: noisy weights (tests only)\n")
    report = run_gate("demo", [modes], tasks=("jargon_cloze", "jargon_copy"), limit=12, gptq=str(degraded_dir),
                      progress=lambda s: None)
    path = write(report, tmp_path / "reports")
    assert report["backend"] == "transformers" and path.name == "demo-transformers.json"
    assert set(report["modes"]) == {"fp16", "prefix_cache", "degraded"}
    assert all(e["pass"] for m in ("fp16", "prefix_cache") for e in report["modes"][m].values())
    assert not all(e["pass"] for e in report["modes"]["degraded"].values())
    assert "jargon_cloze" in path.with_suffix(".md").read_text()
    # each verdict carries its paired interval over the 12 documents both it and fp16 scored; prefix_cache scores
    # fp16's weights, so it differs from fp16 on no document
    for mode in ("prefix_cache", "degraded"):
        for task, entry in report["modes"][mode].items():
            assert len(report["documents"][mode][task]) == 12 and entry["ci"][0] <= entry["delta_pp"] <= entry["ci"][1]
    assert report["modes"]["prefix_cache"]["jargon_cloze"]["ci"] == [0.0, 0.0]

    policy = tmp_path / "policy.yaml"
    policy.write_text("name: prefer-degraded\nrules: []\ndefault: [degraded, prefix_cache]\nfallback: [fp16]\n"
                      "quality: {max_drop_pp: 5.0}\n")
    proc, url, _ = start_server(tmp_path, "--model", "demo", "--backend", "transformers", "--modes-dir", str(modes),
                                "--gptq", str(degraded_dir), "--policy", str(policy), "--gate-report", str(path),
                                "--no-calibrate")
    try:
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        for _ in range(3):  # the policy prefers the degraded mode; the gate never lets a request reach it
            info = requests.post(url + "/v1/completions", json=body, timeout=60).json()["modeswitch"]
            assert info["mode"] == "prefix_cache" and "degraded: fails the quality gate" in info["reason"]
        pinned = requests.post(url + "/v1/completions", json={**body, "mode": "degraded"}, timeout=60)
        assert pinned.status_code == 400 and pinned.json()["error"]["code"] == "mode_unavailable"
        listed = {m["name"]: m for m in requests.get(url + "/v1/modes", timeout=10).json()["modes"]}
        assert listed["degraded"]["quality_gate"].startswith("fails the quality gate")
        assert listed["prefix_cache"]["quality_gate"] == "pass"
        # the row each mode is judged by, scored on the kernels it runs here (the report records its card)
        row = listed["prefix_cache"]["gate_row"]
        assert (row["report"], row["row"], row["same_kernels"]) == ("demo-transformers.json", "prefix_cache", True)
        native = cpu_has_bf16()  # as the server sees the CPU (MODESWITCH_CPU=avx2 says it has no bf16)
        assert row["scored_on"] == listed["prefix_cache"]["kernels"]
        assert row["scored_on"]["weights"] == ("bfloat16" if native else "float32")  # the default reference

        broken = requests.post(url + "/admin/gate", json={"path": str(path.with_name("nope.json"))}, timeout=10)
        assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_gate_report"
        outside = requests.post(url + "/admin/gate", json={"path": str(tmp_path / "policy.yaml")}, timeout=10)
        assert outside.status_code == 400 and outside.json()["error"]["code"] == "path_not_allowed"
        # a report in which the degraded mode passes is picked up without a restart
        edited = json.loads(path.read_text())
        scored = edited["runs"][-1]  # the run write() added
        scored["modes"]["degraded"] = scored["modes"]["fp16"]
        path.write_text(json.dumps(edited))
        assert requests.post(url + "/admin/gate", timeout=10).status_code == 200
        info = requests.post(url + "/v1/completions", json=body, timeout=60).json()["modeswitch"]
        assert info["mode"] == "degraded"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_lm_evals_local_completions_through_the_server_matches_the_adapter(tmp_path, ours):
    """The server as an lm-eval target: echo + logprobs on token-id prompts (scoring) and generation."""
    proc, url, _ = start_server(tmp_path, "--model", "demo", "--backend", "transformers", "--dtype", "float32",
                                "--modes", "fp16,continuous_batching", "--gate-report", "none", "--no-calibrate")
    try:
        theirs = evaluate("local-completions", tasks=("jargon_cloze", "jargon_copy"), limit=20, model_args=(
            f"base_url={url}/v1/completions,model=demo,tokenizer_backend=huggingface,"
            f"tokenizer={prepare_demo_checkpoint()},tokenized_requests=True,num_concurrent=1,max_retries=1"))["results"]
        assert theirs["jargon_cloze"]["acc,none"] == ours["jargon_cloze"]["acc,none"] >= 0.6
        assert theirs["jargon_copy"]["exact_match,first_word"] == ours["jargon_copy"]["exact_match,first_word"]
        # scoring requests never reach continuous batching, which cannot return prompt logprobs
        modes = {m["name"]: m for m in requests.get(url + "/v1/modes", timeout=10).json()["modes"]}
        assert modes["fp16"]["stats"]["requests"] > 80
        info = requests.get(url + "/tokenizer_info", timeout=10).json()
        assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 8192
        tok = requests.post(url + "/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
        back = requests.post(url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json()
        assert tok["count"] == len(tok["tokens"]) == 2 and back["prompt"] == "Hello world"
    finally:
        proc.kill()
        proc.wait(timeout=30)
