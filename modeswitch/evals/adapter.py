"""lm-eval model ``modeswitch``: any mode of the registry as an lm-eval LM.

    lm_eval --model modeswitch --model_args model=demo,mode=gptq --tasks jargon_cloze --include_path evals/tasks

Loglikelihoods are computed from the mode's resident weights (what decides a mode's accuracy: prefix
reuse, batching and speculative decoding change how tokens are produced, not their probabilities);
``generate_until`` runs through the mode's real engine, so speculative, batched and prefix-cached
decoding are what gets scored there. Tokenization follows lm-eval's ``TemplateLM`` like its ``hf``
model, so scores are comparable with ``--model hf`` on the same checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval import models as _builtin_models  # noqa: F401  (load the registry first, or 'hf' disappears)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..compose import all_shipped_modes, build_service
from ..config import NO_GATE, LoadConfig, ServerConfig
from ..controller.rules import RulePolicy
from ..engines.base import SamplingParams
from ..modes import ModeSpec


@register_model("modeswitch")
class ModeSwitchLM(TemplateLM):
    backend = "causal"

    def __init__(self, model: str = "demo", mode: str = "fp16", max_length: int = 2048, batch_size: int = 1,
                 device: str = "auto", gptq: str | None = None, spec: ModeSpec | None = None, **kwargs) -> None:
        """``mode`` names a mode of modes/ or modes/extra, or ``spec`` gives one (the gate passes its own)."""
        super().__init__()
        if spec is None:
            specs = {m.name: m for m in all_shipped_modes()}
            if mode not in specs:
                raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(specs)}")
            spec = specs[mode]
        self.mode = mode = spec.name
        config = ServerConfig(model=model, gptq=gptq, gate_report=NO_GATE,
                              load=LoadConfig(engine="transformers", device=device, max_model_len=max_length))
        policy = RulePolicy(name=f"lm-eval:{mode}", rules=(), default=(mode,), fallback=())
        self.service = build_service(config, progress=lambda s: None, specs=[spec], policy=policy)
        self.registry = self.service.registry
        state = self.registry.modes[mode]
        if not state.available:
            self.registry.close()
            raise RuntimeError(f"mode {mode} is unavailable: {state.reason}")
        self.tokenizer = self.registry.tokenizer
        self.scorer = self.registry.backend.weights.models[spec.weights]  # the transformers backend's weights
        self._max_length = max_length

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

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) and whether the continuation is the greedy one."""
        tokens = (context + continuation)[-(self.max_length + 1):]
        inputs = torch.tensor([tokens[:-1]], device=self.scorer.device)
        logprobs = F.log_softmax(self.scorer(inputs).logits[0, -len(continuation):].float(), dim=-1)
        target = torch.tensor(continuation, device=logprobs.device)
        total = logprobs.gather(1, target[:, None]).sum().item()
        return total, bool((logprobs.argmax(dim=-1) == target).all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for _, context_enc, continuation_enc in tqdm(requests, disable=disable_tqdm, desc=f"loglikelihood {self.mode}"):
            out.append(self._score(context_enc, continuation_enc))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc=f"rolling {self.mode}"):
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            out.append(sum(self._score(ctx, cont)[0] for ctx, cont in windows))
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
            gen = self.service.start(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature),
                                     stop=tuple(until), mode=self.mode)
            gen.prime()
            out.append("".join(gen.deltas()))
        return out
