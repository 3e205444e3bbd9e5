"""Which vLLM engines serve the modes, what each one runs with, and on which cores.

vLLM engines cannot share weights, so every set of weights (with its draft model, where a mode drafts with one)
gets one engine (a :class:`~modeswitch.engines.vllm.engine.VllmRunner`) and the modes that differ only per request
share it through their own fronts; n-gram speculation is one of those (the engine drafts for its speculative
modes' requests only, see ``engines.vllm.drafting``). A mode may ask for an engine of its own (``own_engine``):
on a CPU with two or more cores it gets one, on cores of its own, so that a burst can be spread over two engines
on the same weights; on a GPU or a single CPU every engine shares one lane, and a second engine would only hold
the weights twice. This module decides what each engine runs: the checkpoint and quantization of a variant on
this device, the draft, the dtype, the KV bytes and batch bound of the modes planned onto it, its CPUs.
"""

from __future__ import annotations

import os
from typing import Any

from ...engines.vllm.args import engine_args, has_cpu_kernel
from ...memory import Footprint, MemoryPlan
from ...modes import NGRAM_MAX, NGRAM_MIN, ModeSpec
from ...weight_kinds import GPTQ, KINDS, REFERENCE
from ...weights.precision import dtype_name
from ...weights.presets import WeightsNotFound, demo_to_build, local_or_hub
from ...weights.store import VariantUnavailable
from ..base import KernelUnavailable, Progress
from ..checkpoint import Checkpoint

#: what one engine's process holds on a CPU beyond its weights and KV pool (vLLM, torch and their Python heap,
#: oneDNN's and Inductor's caches, activations): about what the demo's engines hold beyond their planned weights
#: and KV (their PSS), the int8 engines more (their oneDNN kernels keep their own copy of the weights). On a GPU
#: the plan counts device memory and plans weights and KV only: an engine's runtime there (CUDA context, graphs,
#: activations) is not planned.
CPU_ENGINE_RUNTIME_BYTES = 2**30

#: KV an engine's pool holds beyond what its modes reserve: two of vLLM's CPU KV blocks (128 tokens), for the last
#: block of a full-length sequence and the lookahead slots an engine that drafts reserves for it; what vLLM needs to
#: take one ``--max-model-len`` request beside the stored prefixes the plan keeps
KV_ROUNDING_TOKENS = 256


def affinity() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


class EngineLayout:
    """The modes planned so far, by the engine each maps onto (its key), and each engine's arguments."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.specs: dict[str, ModeSpec] = {}
        #: the engine started first (the policy's first modes): the first on the CPUs
        self.first: str | None = None

    def key(self, spec: ModeSpec) -> str:
        """The engine a mode maps onto: its weights, plus its draft model when it drafts with one; the mode's
        own (named for it) where it asks for one and has cores to run it on (see the module's docstring)."""
        if spec.speculative is not None and (draft := self.checkpoint.draft_variant(spec)) is not None:
            return f"{spec.weights}+{draft}-draft"
        if spec.own_engine and self.lanes():
            return spec.name
        return spec.weights

    def engines(self, plan: MemoryPlan) -> list[str]:
        """The engines of ``plan``: its holders this backend planned (a plan shared with another engine family
        holds that family's too, see ``backends.fallback``)."""
        mine = {self.key(spec) for spec in self.specs.values()}
        return [key for key in plan.users if key in mine]

    def footprint(self, spec: ModeSpec) -> Footprint:
        """What ``spec`` adds to its engine; remembered, so that each engine is sized for every mode on it."""
        variants = self.checkpoint.variant_bytes(spec)
        self.source(spec, build=False)
        for draft in list(variants)[1:]:  # a GPTQ draft needs vLLM's GPTQ kernel too
            self.check_kernel(draft)
        kv, detail = self.checkpoint.kv(spec, variants)
        kv += KV_ROUNDING_TOKENS * self.checkpoint.shape.kv_bytes_per_token
        detail += f" + {KV_ROUNDING_TOKENS} tokens of block rounding"
        key = self.key(spec)
        self.specs[spec.name] = spec
        runtime = CPU_ENGINE_RUNTIME_BYTES if self.checkpoint.device.type == "cpu" else 0
        return Footprint(spec.name, key, kv, detail, {key: sum(variants.values())}, kv_pool=key,
                         runtime_bytes={key: runtime})

    def check_kernel(self, variant: str) -> None:
        """Raise KernelUnavailable where vLLM's kernels for this CPU cannot multiply ``variant``'s weights (asked
        before any engine starts: an engine started without its kernel loads, then dies at its first step)."""
        kind = KINDS.get(variant)
        needed = kind.vllm_cpu_kernel if kind is not None else None
        if needed is not None and self.checkpoint.device.type == "cpu" and not has_cpu_kernel(needed[0]):
            raise KernelUnavailable(f"vLLM's kernels for this CPU have no {needed[1]} ({needed[0]}{needed[2]})")

    def source(self, spec: ModeSpec, build: bool = True) -> str:
        """The checkpoint a mode's engine loads (vLLM reads its quantization from the checkpoint's config): its
        weight kind's, where vLLM serves the kind from a checkpoint of its own (``WeightKind.vllm_checkpoint``:
        INT8 from the preset's W8A8 one, int8 weights and activations on a CPU and a GPU alike; the demo builds its
        own, ``modeswitch.weights.quantize.build_w8a8``), else the one the weight store resolves. ``build`` False:
        a demo checkpoint not built yet is returned unresolved (see ``WeightStore.ref``)."""
        weights, preset, kind = self.checkpoint.weights, self.checkpoint.preset, KINDS[spec.weights]
        self.check_kernel(kind.name)
        if kind.vllm_checkpoint is None:
            return weights.ref(kind.name, build)
        source = getattr(preset, kind.vllm_checkpoint)
        if not source:
            raise VariantUnavailable(f"model {preset.name} has no {kind.vllm_checkpoint} checkpoint for vLLM's "
                                     f"{kind.name} (a preset's {kind.vllm_checkpoint})")
        try:
            if not build and demo_to_build(source):
                return source
            return local_or_hub(source, f"{kind.name} ({kind.vllm_checkpoint}) weights of {preset.name}")
        except WeightsNotFound as exc:  # only the modes on this kind go without it
            raise VariantUnavailable(str(exc)) from None

    def build_demo_checkpoints(self, key: str, plan: MemoryPlan, idle: bool, progress: Progress) -> None:
        """Build the demo checkpoints engine ``key`` loads that are not built yet, in a child process (under
        SCHED_IDLE when the engine starts behind requests served): the demo's GPTQ checkpoint takes minutes of
        calibration on a CPU, and a first start serves before it exists, its modes loading meanwhile."""
        spec = self.specs[plan.users[key][0]]
        draft = self.checkpoint.draft_variant(spec) if spec.speculative is not None else None
        sources = [self.source(spec, build=False)]
        if draft:
            sources.append(self.checkpoint.weights.ref(draft, build=False))
        self.checkpoint.build_demo(sources, spec.name, idle, progress)

    def args(self, key: str, plan: MemoryPlan, eager: bool) -> dict[str, Any]:
        """Engine ``key`` sized for every mode planned onto it: its KV pool, their queue bounds summed."""
        specs = [self.specs[m] for m in plan.users[key]]
        return self.engine_args(specs, plan.pools[key], sum(s.max_queue for s in specs), self.cpus(key, plan), eager)

    def engine_args(self, specs: list[ModeSpec], kv_bytes: int, max_num_seqs: int, cpus: list[int] | None = None,
                    eager: bool = False) -> dict[str, Any]:
        """vLLM's arguments for the engine of the modes ``specs`` (one set of weights): it speculates when any
        of them does, proposing as many tokens a step as the most any asks for (each request is bounded by
        its own mode's, see ``VllmFront``)."""
        checkpoint, spec = self.checkpoint, specs[0]
        drafting = [s for s in specs if s.speculative is not None]
        draft = checkpoint.draft_variant(drafting[0]) if drafting else None
        # every engine computes in the reference dtype (the device's native 16-bit type; fp32 where it has none or
        # ``--dtype float32``), but vLLM's CPU GPTQ kernel takes bf16/fp16 activations only, and a draft runs in its
        # target's dtype
        gptq_on_cpu = checkpoint.device.type == "cpu" and GPTQ.name in (spec.weights, draft)
        dtype = dtype_name(checkpoint.dtype)
        speculative = None
        if drafting:
            k = max(s.speculative.num_tokens for s in drafting)
            speculative = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": NGRAM_MAX,
                            "prompt_lookup_min": NGRAM_MIN} if draft is None
                           else {"model": checkpoint.weights.ref(draft), "num_speculative_tokens": k})
        return engine_args(
            model=self.source(spec), tokenizer=checkpoint.weights.ref(REFERENCE.name),
            dtype="bfloat16" if gptq_on_cpu and dtype == "float32" else dtype,
            max_model_len=checkpoint.context_length, kv_bytes=kv_bytes, max_num_seqs=max_num_seqs,
            enforce_eager=eager, speculative_config=speculative, cpus=cpus)

    def cpus(self, key: str, plan: MemoryPlan) -> list[int]:
        """The CPUs engine ``key`` computes on, on a CPU with two or more: vLLM would bind each engine's worker to
        all CPUs but one (the one it leaves to an engine's scheduler process), every engine the same way, so every
        engine of a server computed on the same CPUs and the engines took turns. Here each engine gets as many
        CPUs (all but one: an engine's scheduler runs between its steps, on the same thread), rotated by one per
        engine: the first mode's engine first, then the others on its weights (a mode's engine of its own: the
        two a burst is spread over), then the rest, the engines on one set of weights one after another; so that
        two engines on the same weights serve a burst on different cores at once. Empty on a GPU or a single CPU
        (nothing to rotate)."""
        if not self.lanes():
            return []
        keys = self.engines(plan)
        cpus = affinity()
        first = self.first or keys[0]
        weights = {k: self.specs[plan.users[k][0]].weights for k in keys}
        kinds = list(dict.fromkeys(weights[k] for k in keys))
        order = sorted(keys, key=lambda k: (k != first, weights[k] != weights[first], kinds.index(weights[k]),
                                            keys.index(k)))
        i, width = order.index(key), len(cpus) - 1
        return [cpus[(i + j) % len(cpus)] for j in range(width)]

    def lanes(self) -> bool:
        """Whether engines can compute on cores of their own here: a CPU with two or more."""
        return self.checkpoint.device.type == "cpu" and len(affinity()) > 1
