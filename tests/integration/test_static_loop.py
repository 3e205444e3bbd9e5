"""The owned static-cache decode loop (modeswitch.engines.static.loop) and the kernels its modes ride.

Greedy outputs must equal their references: ``model.generate`` for fp16, prefix reuse and speculative decoding
(n-gram and a GPTQ self-draft), and each quantized model's own eager output for its compiled path. The demo model
runs the loop eagerly (what the loop computes is the same compiled or not; compiling the 135M model on 2 CPU
cores takes minutes); one test compiles a tiny random Llama with Inductor to check that path end to end.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeswitch.backends.transformers import TransformersBackend
from modeswitch.config import LoadConfig
from modeswitch.device import resolve_device_dtype
from modeswitch.engines.base import GenRequest
from modeswitch.sampling_params import SamplingParams
from modeswitch.engines.static.drafts import ModelDrafter, NgramDrafter
from modeswitch.engines.transformers.prefix_kv import PrefixKVStore
from modeswitch.engines.static.sampling import accept, processed
from modeswitch.engines.static.decoder import StaticDecoder
from modeswitch.engines.static.loop import StaticLoopEngine
from modeswitch.weights.kernels import Int4Linear, Int8WeightOnlyLinear, quantize_int8_weight_only, repack_gptq
from modeswitch.weights.presets import PRESETS
from modeswitch.modes import load_modes
from modeswitch.serving.registry import ModeRegistry
from modeswitch.weights.store import WeightStore

TOKENS = 12
CTX = 512


@pytest.fixture(scope="module")
def demo() -> WeightStore:
    device, dtype = resolve_device_dtype("cpu", "float32")
    store = WeightStore(PRESETS["demo"], device, dtype)
    store.get("fp16", progress=lambda s: None)
    return store


@pytest.fixture(scope="module")
def tok(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo.ref("fp16"))


@pytest.fixture(scope="module")
def gptq():
    """The demo's GPTQ model as GPTQModel loads it, then repacked: (model, original layers of block 0, their
    GPTQModel dequantized weights taken before the repack)."""
    device, dtype = resolve_device_dtype("cpu", "float32")
    model = WeightStore(PRESETS["demo"], device, dtype).get("gptq", progress=lambda s: None)  # GPTQModel's layers
    layer = model.model.layers[0]
    originals = {name: layer.get_submodule(name) for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")}
    dequantized = {name: q.dequantize_weight().t().float() for name, q in originals.items()}  # [out, in]
    repacked = repack_gptq(model)  # before any forward: GPTQModel's CPU kernel repacks its tensors on first use
    return model, originals, dequantized, repacked


def reference(model, ids: list[int], n: int = TOKENS) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


def run(engine, ids: list[int], n: int = TOKENS, **params) -> tuple[list[int], dict]:
    req = GenRequest(prompt_ids=list(ids), params=SamplingParams(max_tokens=n, **params))
    engine.submit(req)
    tokens: list[int] = []
    while True:
        event = req.events.get(timeout=120)
        if event.kind == "tokens":
            tokens += event.token_ids
        elif event.kind == "error":
            raise AssertionError(event.info)
        else:
            return tokens, event.info


@pytest.fixture
def engines():
    made = []
    yield made
    for engine in made:
        engine.close()


def loop(engines, model, **kwargs) -> StaticLoopEngine:
    engine = StaticLoopEngine("test", model, 8, CTX, **kwargs)
    engines.append(engine)
    return engine


def test_loop_greedy_equals_generate_and_scores(demo, tok, engines):
    model = demo.models["fp16"]
    engine = loop(engines, model)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = tok(prompt).input_ids
        tokens, info = run(engine, ids)
        assert tokens == reference(model, ids) and info["finish_reason"] in ("length", "stop")
    # sampling runs through the same loop (temperature, top-p); scoring is the shared worker's
    tokens, _ = run(engine, tok("Once upon a time").input_ids, temperature=0.8, top_p=0.9)
    assert len(tokens) == TOKENS
    _, info = run(engine, tok("One two three").input_ids, n=1, prompt_logprobs=2)
    assert len(info["logprobs"]["token_logprobs"]) == len(tok("One two three").input_ids) + 1
    assert engine.stats()["requests"] == 4


def test_prefix_reuse_through_the_loop_equals_fp16(demo, tok, engines):
    model = demo.models["fp16"]
    store = PrefixKVStore(4096)
    engine = loop(engines, model, prefix_store=store)
    shared = tok("A long shared preamble about rivers, mountains and the weather in the north. ").input_ids * 3
    first, info = run(engine, shared + tok("Question one:").input_ids)
    assert info["cached_tokens"] == 0
    ids = shared + tok("Question two is different:").input_ids
    tokens, info = run(engine, ids)
    assert info["cached_tokens"] >= len(shared)  # the stored prompt + answer covers the shared part
    assert tokens == reference(model, ids)
    assert store.hits == 1 and engine.prefix_match(ids) >= len(ids) - 1  # now its own answer is stored too


def test_speculative_ngram_equals_fp16_and_accepts_drafts(demo, tok, engines):
    model = demo.models["fp16"]
    engine = loop(engines, model, drafter=NgramDrafter(4))
    ids = tok("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,").input_ids
    tokens, info = run(engine, ids, n=20)
    assert tokens == reference(model, ids, 20)
    spec = info["speculative"]
    assert spec["accepted_draft_tokens"] > 0 and spec["target_steps"] < 20


def test_speculative_gptq_self_draft_equals_fp16(demo, tok, gptq, engines):
    model = demo.models["fp16"]
    drafter = ModelDrafter(StaticDecoder(gptq[0], CTX), 3)
    engine = loop(engines, model, drafter=drafter)
    ids = tok("The three primary colors are").input_ids
    tokens, info = run(engine, ids, n=16)
    assert tokens == reference(model, ids, 16)
    assert info["speculative"]["accepted_draft_tokens"] > 0  # the 4-bit copy agrees with fp16 on some tokens


def test_gptq_repack_equals_the_gptq_dequantized_matmul(gptq):
    model, originals, dequantized, repacked = gptq
    layer = model.model.layers[0]
    assert repacked == 7 * model.config.num_hidden_layers
    assert type(model.model.layers[3].mlp.up_proj) is Int4Linear and repack_gptq(model) == 0
    for name, q in originals.items():
        repacked = layer.get_submodule(name)
        x = torch.randn(3, q.in_features)
        expected = x.to(torch.bfloat16).float() @ dequantized[name].t()  # the kernel takes bf16 activations
        got = repacked(x)
        assert got.dtype == x.dtype
        torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))
        with torch.inference_mode():
            torch.testing.assert_close(got, q(x), rtol=1e-2, atol=1e-2)  # and GPTQModel's kernel itself


def test_sampled_acceptance_keeps_the_target_distribution():
    """Point-mass drafts accepted with p(d), else resampled without d: the first token is distributed as p."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(max_tokens=4, temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[accept(logits, [1], params, gen)[0]] += 1
    torch.testing.assert_close(counts / counts.sum(), torch.softmax(logits[0], -1), atol=0.03, rtol=0)
    greedy = SamplingParams(max_tokens=4)
    assert accept(logits, [0], greedy) == [0, 0] and accept(logits, [2], greedy) == [0]
    nucleus = processed(torch.tensor([[3.0, 2.0, 0.0, -5.0]]), SamplingParams(max_tokens=1, temperature=1.0, top_p=0.8))
    assert nucleus[0].isfinite().tolist() == [True, True, False, False]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def test_int8_weight_only_compiled_equals_its_eager_output(engines):
    """Inductor compiles the loop's steps over int8 weight-only layers; tokens equal the same model's eager ones,
    and two compiled engines on one model keep to their own caches."""
    model = tiny_llama()
    fp_linear = model.model.layers[0].mlp.up_proj
    assert quantize_int8_weight_only(model) == 14
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer, Int8WeightOnlyLinear) and layer.weight.dtype == torch.int8
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), fp_linear(x), rtol=0.05, atol=0.02)
    prompt = [5, 17, 99, 3, 42, 8, 8, 1, 200, 13]
    eager, _ = run(loop(engines, model, chunk=8), prompt, n=10)
    compiled_engine = loop(engines, model, chunk=8, compile="default")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled_engine.warm_up() > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= graphs + 2  # prefill chunk and decode step
    compiled, _ = run(compiled_engine, prompt, n=10)
    assert compiled == eager == reference(model, prompt, 10)
    # a second mode on the same weights reuses the compiled steps over its own cache: neither disturbs the other
    other = loop(engines, model, chunk=8, compile="default")
    other.warm_up()
    prompt2 = [9, 9, 100, 4, 3, 2, 77]
    assert run(other, prompt2, n=6)[0] == reference(model, prompt2, 6)
    assert run(compiled_engine, prompt, n=10)[0] == compiled


def test_decode_compiled_builds_cpu_modes_on_the_loop(demo, tok):
    """``--decode compiled`` on a CPU: every one-at-a-time mode (INT8 weight-only and GPTQ repacked too) is an
    owned-loop engine with its warm-up time in its details and the start-up times; each serves a request.
    The loop runs eager here (``loop_compile = None``) to keep the test in seconds."""
    load = LoadConfig(device="cpu", decode="compiled", max_model_len=CTX)
    backend = TransformersBackend(PRESETS["demo"], load)
    backend.loop_compile = None
    names = ("fp16", "int8", "gptq", "prefix_cache", "speculative")
    registry = ModeRegistry(PRESETS["demo"], [m for m in load_modes() if m.name in names], load, backend=backend)
    registry.load(progress=lambda s: None)
    try:
        ids = tok("The capital of France is").input_ids
        expected = reference(demo.models["fp16"], ids)
        for name in names:
            state = registry.modes[name]
            assert state.available, (name, state.reason)
            assert isinstance(state.engine, StaticLoopEngine) and state.details["decode"].startswith("owned")
            assert state.details["warmup_s"] > 0 and f"warmup:{name}" in registry.startup_seconds()
            tokens, _ = run(state.engine, ids)
            if name in ("fp16", "prefix_cache", "speculative"):
                assert tokens == expected, name
            else:
                assert len(tokens) == TOKENS and tokens[0] == expected[0], name
        int8 = backend.weights.models["int8"].model.layers[0].self_attn.q_proj
        assert isinstance(int8, Int8WeightOnlyLinear)
        assert isinstance(backend.weights.models["gptq"].model.layers[0].self_attn.q_proj, Int4Linear)
        # other int8 and gptq kernels than the eager engine's: a gate report scored there does not hold here
        assert registry.gate_key == "transformers-compiled" != TransformersBackend(PRESETS["demo"], LoadConfig()).gate_key
    finally:
        registry.close()


def test_loop_honours_the_request_options_as_generate_does(demo, tok, engines):
    """The owned loop runs the same logits processors as the ``generate()`` engine: a grammar, a logit bias,
    logprobs, a seed; a drafting loop refuses what its verify step cannot apply."""
    from modeswitch.sampling_params import Constraint
    from modeswitch.engines.grammar import Grammars
    from modeswitch.engines.transformers.engines import GenerateEngine

    model = demo.models["fp16"]
    grammars = Grammars(tok, model.config.vocab_size)
    engine = loop(engines, model, grammars=grammars)
    reference_engine = GenerateEngine("generate", model, 8, grammars=grammars)
    engines.append(reference_engine)
    ids = tok("My favourite colour is").input_ids
    for options in ({"constraint": Constraint("choice", '["red", "blue"]')}, {"logit_bias": ((28, 100.0),)},
                    {"temperature": 1.0, "seed": 5, "top_k": 20}, {"logprobs": 2}):
        assert run(engine, ids, **options)[0] == run(reference_engine, ids, **options)[0], options
    tokens, _ = run(engine, ids, n=3, logit_bias=((28, 100.0),))
    assert tokens == [28, 28, 28]
    drafting = loop(engines, model, drafter=NgramDrafter(3), grammars=grammars)
    assert "structured_outputs" in engine.capabilities and "structured_outputs" not in drafting.capabilities
    assert {"temperature", "seed"} <= drafting.capabilities
