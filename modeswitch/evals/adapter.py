"""lm-eval model ``modeswitch``: any mode of the registry as an lm-eval LM, scored on the engine that serves it.

    lm_eval --model modeswitch --model_args model=demo,mode=gptq,backend=vllm --tasks jargon_cloze \
        --include_path evals/tasks

Everything goes through the server's own engines, as a request would: loglikelihoods are prompt-scoring
requests (what ``echo`` + ``logprobs`` asks of the HTTP API) on the plain mode of the mode's weights — its
probabilities are the weights' on that engine (prefix reuse, batching and speculative decoding change how
tokens are produced, not their probabilities), so vLLM's int8 weight-only kernels are scored as vLLM serves
them, not as transformers would; ``generate_until`` runs on the mode itself, so speculative, batched and
prefix-cached decoding are what gets scored there. Tokenization follows lm-eval's ``TemplateLM`` like its
``hf`` model, so scores are comparable with ``--model hf`` on the same checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from lm_eval import models as _builtin_models  # noqa: F401  (load the registry first, or 'hf' disappears)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..compose import all_shipped_modes, build_service
from ..config import NO_GATE, LoadConfig, ServerConfig
from ..controller.rules import RulePolicy
from ..sampling_params import SamplingParams
from ..modes import ModeSpec
from ..serving.service import Service
from ..weight_kinds import REFERENCE_MODE

#: scoring requests a derived scoring mode takes at once: a batching engine (vLLM) scores them in one batch
SCORING_WINDOW = 16


def scoring_mode(spec: ModeSpec) -> ModeSpec:
    """The mode that scores ``spec``'s weights: ``spec`` itself where it is plain, else the same weights decoded
    one token at a time without prefix reuse — every engine can return prompt logprobs for that (transformers'
    continuous batching cannot), and on vLLM it runs on the very engine that serves ``spec``'s weights."""
    plain = ModeSpec(name=f"score-{spec.weights}", weights=spec.weights, max_queue=SCORING_WINDOW,
                     description=f"{spec.weights} weights, plain: scores prompts for lm-eval")
    as_plain = dataclasses.replace(spec, name=plain.name, max_queue=plain.max_queue, description=plain.description,
                                   source=plain.source)
    return spec if as_plain == plain else plain


@register_model("modeswitch")
class ModeSwitchLM(TemplateLM):
    backend = "causal"

    def __init__(self, model: str = ServerConfig.model, mode: str = REFERENCE_MODE, max_length: int = 2048,
                 batch_size: int = 1, device: str = LoadConfig.device, gptq: str | None = None,
                 backend: str = "transformers", spec: ModeSpec | None = None, dtype: str = LoadConfig.dtype,
                 service: Service | None = None, before_request: Callable[[], None] | None = None,
                 **kwargs) -> None:
        """``mode`` names a mode of modes/ or modes/extra, or ``spec`` gives one (the gate passes its own);
        ``backend`` is the engine family and ``dtype`` the reference dtype, as ``serve.py`` takes them.
        ``service``: score ``mode`` on a running server's service instead of building one (see :meth:`_on`);
        ``before_request``: called before each request is sent (a server's scorer waits there for idle engines)."""
        super().__init__()
        self._before = before_request or (lambda: None)
        #: the longest one of its requests took, first token to last (what a request behind it could wait for)
        self.longest_s = 0.0
        self._owned = service is None
        if service is not None:
            self._on(service, mode, max_length)
            return
        if spec is None:
            specs = {m.name: m for m in all_shipped_modes()}
            if mode not in specs:
                raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(specs)}")
            spec = specs[mode]
        self.mode = mode = spec.name
        scorer = scoring_mode(spec)
        self.scored_on = scorer.name
        self.window = scorer.max_queue  # scoring requests in flight at once (more would find the mode saturated)
        specs = [spec] if scorer is spec else [spec, scorer]
        # +2: a scored sequence of max_length + 1 tokens (as lm-eval's hf model truncates) plus one generated
        # one mode, pinned: the engines' measured costs order nothing, and calibrating would take scoring slots
        config = ServerConfig(model=model, gptq=gptq, gate_report=NO_GATE, calibrate=False,
                              load=LoadConfig(backend=backend, device=device, dtype=dtype, max_model_len=max_length + 2,
                                              staged=False))
        policy = RulePolicy(name=f"lm-eval:{mode}", rules=(), default=(mode,), fallback=())
        self.service = build_service(config, progress=lambda s: None, specs=specs, policy=policy)
        self.registry = self.service.registry
        self.backend = self.registry.gate_key  # what the scores hold for
        #: what the mode's linears run (its /v1/modes card): the report records the kernels each row was scored on
        self.kernels = self.registry.modes[mode].details.get("kernels")
        for name in {mode, scorer.name}:
            state = self.registry.modes[name]
            if not state.available:
                self.registry.close()
                raise RuntimeError(f"mode {name} is unavailable: {state.reason}")
        self.tokenizer = self.registry.tokenizer
        self._max_length = max_length

    def _on(self, service: Service, mode: str, max_length: int) -> None:
        """Score ``mode`` on ``service`` as it serves: its prompts on a resident mode of the same weights that
        returns prompt logprobs (a plain one first, else the mode itself), one request at a time."""
        self.service, self.registry, self.mode = service, service.registry, mode
        state = self.registry.modes.get(mode)
        if state is None or not state.available:
            raise RuntimeError(f"mode {mode} is not available here")
        same = [s for s in self.registry.modes.values() if s.available and s.spec.weights == state.spec.weights
                and "prompt_logprobs" in s.capabilities]
        plain = [s for s in same if scoring_mode(s.spec) is s.spec]
        scorer = next(iter(plain), state if any(s is state for s in same) else None)
        if scorer is None:
            raise RuntimeError(f"no mode on {state.spec.weights} weights here returns prompt logprobs")
        self.scored_on, self.window = scorer.name, 1
        self.backend, self.kernels = self.registry.gate_key, state.kernels
        self.tokenizer = self.registry.tokenizer
        self._max_length = min(max_length, self.registry.context_length - 2)

    def close(self) -> None:
        """Close the engines this model built (a running server's stay up)."""
        if self._owned:
            self.registry.close()

    # ------------------------------------------------------------------ tokenization (as lm-eval's hf model)
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------ scoring (prompt logprobs on the engine)
    def _score_all(self, pairs: list[tuple[list[int], list[int]]], desc: str,
                   disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Per (context, continuation): the sum of log p(continuation | context) and whether the continuation
        is the greedy one, from scoring requests on the scoring mode, as many in flight as it queues."""
        out: list[tuple[float, bool]] = []
        bar = tqdm(total=len(pairs), disable=disable_tqdm, desc=desc)
        for start in range(0, len(pairs), self.window):
            window = pairs[start:start + self.window]
            self._before()
            sequences = [(ctx + cont)[-(self.max_length + 1):] for ctx, cont in window]
            gens = [self.service.start(seq, SamplingParams(max_tokens=1, prompt_logprobs=1), mode=self.scored_on)
                    for seq in sequences]
            for gen, seq, (_, cont) in zip(gens, sequences, window):
                for _ in gen.deltas():  # the one generated token; the scores come with the end of the request
                    pass
                self._took(gen)
                positions = range(len(seq) - len(cont), len(seq))
                total = sum(gen.logprobs["token_logprobs"][i] for i in positions)
                greedy = all(max(gen.logprobs["top_logprobs"][i].items(), key=lambda kv: kv[1])[0] == seq[i]
                             for i in positions)
                out.append((total, greedy))
                bar.update()
        bar.close()
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        return self._score_all([(ctx, cont) for _, ctx, cont in requests], f"loglikelihood {self.mode}", disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc=f"rolling {self.mode}"):
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            out.append(sum(total for total, _ in self._score_all(list(windows), "", disable_tqdm=True)))
        return out

    # ------------------------------------------------------------------ generation (the mode's real engine)
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm, desc=f"generate {self.mode}"):
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = int(gen_kwargs.get("max_gen_toks", 256))
            temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
            prompt = self.tok_encode(context)[-(self.max_length - max_tokens):]
            self._before()
            gen = self.service.start(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature),
                                     stop=tuple(until), mode=self.mode)
            gen.prime()
            out.append("".join(gen.deltas()))
            self._took(gen)
        return out

    def _took(self, gen) -> None:
        if gen.finished_at is not None:
            self.longest_s = max(self.longest_s, gen.finished_at - gen.started_at)
