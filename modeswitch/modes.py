"""Mode definitions: data in ``modes/*.yaml``, validated here into frozen :class:`ModeSpec` objects.

A mode is a combination of weight variant and serving options. Engines read these options as
parameters; adding a mode is adding a file, not code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .resources import MODES_DIR
from .weight_kinds import KINDS
from .yamlconf import ConfigError, Section, load_yaml

WEIGHTS = tuple(KINDS)
DECODING = ("standard", "speculative")
BATCHING = ("none", "continuous")
#: the n-gram sizes prompt-lookup drafting matches on vLLM engines, the longest first (vLLM's ``prompt_lookup_min``
#: and ``prompt_lookup_max``); the controller's replay of that drafting (``controller.speculation``) matches the same
NGRAM_MIN, NGRAM_MAX = 2, 4

DEFAULT_MODES_DIR = MODES_DIR


@dataclass(frozen=True)
class SpeculativeSpec:
    """Where draft tokens come from. ``auto``: the preset's draft model when it names one, else prompt-lookup
    n-grams; ``ngram``: always n-grams; ``model``: the preset's draft model (required); ``gptq``: the GPTQ
    weights of the same model, already resident for the gptq modes (a quantized self-draft)."""

    draft: str = "auto"
    num_tokens: int = 10


@dataclass(frozen=True)
class ModeSpec:
    name: str
    weights: str
    decoding: str = "standard"
    speculative: SpeculativeSpec | None = None
    prefix_cache: bool = False
    prefix_cache_tokens: int = 8192
    batching: str = "none"
    max_queue: int = 8
    #: vLLM on a CPU with cores to spare: run on an engine of its own (its weights again, on its own cores)
    #: rather than share its weights' engine; a second engine to spread a burst over (see ``backends.vllm.layout``)
    own_engine: bool = False
    description: str = ""
    source: str = ""


def parse_mode(data, source: str) -> ModeSpec:
    sec = Section(data, source)
    sec.only({"name", "description", "weights", "decoding", "speculative", "prefix_cache", "prefix_cache_tokens",
              "batching", "max_queue", "own_engine"})
    decoding = sec.get("decoding", str, ModeSpec.decoding, DECODING)
    spec = None
    spec_sec = sec.section("speculative", None)
    if decoding == "speculative":
        spec_sec = spec_sec or Section({}, source, "speculative")
        spec_sec.only({"draft", "num_tokens"})
        spec = SpeculativeSpec(
            draft=spec_sec.get("draft", str, SpeculativeSpec.draft, ("auto", "ngram", "model", "gptq")),
            num_tokens=spec_sec.get("num_tokens", int, SpeculativeSpec.num_tokens),
        )
        if spec.num_tokens < 1:
            raise spec_sec.error("must be at least 1", "num_tokens")
    elif spec_sec is not None:
        raise sec.error("only allowed with decoding: speculative", "speculative")
    mode = ModeSpec(
        name=sec.get("name", str),
        description=sec.get("description", str, ModeSpec.description),
        weights=sec.get("weights", str, choices=WEIGHTS),
        decoding=decoding,
        speculative=spec,
        prefix_cache=sec.get("prefix_cache", bool, ModeSpec.prefix_cache),
        prefix_cache_tokens=sec.get("prefix_cache_tokens", int, ModeSpec.prefix_cache_tokens),
        batching=sec.get("batching", str, ModeSpec.batching, BATCHING),
        max_queue=sec.get("max_queue", int, ModeSpec.max_queue),
        own_engine=sec.get("own_engine", bool, ModeSpec.own_engine),
        source=source,
    )
    if mode.max_queue < 1:
        raise sec.error("must be at least 1", "max_queue")
    if mode.batching == "continuous" and mode.decoding == "speculative":
        raise sec.error("speculative decoding cannot run under continuous batching (transformers runs it at batch 1)",
                        "decoding")
    return mode


def _like(spec: ModeSpec, other: ModeSpec) -> bool:
    """Whether ``other`` serves requests as ``spec`` does (decoding, batching) on other weights, without an engine
    of its own: where ``spec``'s engine of its own may go."""
    return (other.weights != spec.weights and other.decoding == spec.decoding and other.batching == spec.batching
            and not other.own_engine)


def own_engine_on(specs: list[ModeSpec], weights: str) -> tuple[list[ModeSpec], list[str]]:
    """``specs`` with each engine of its own (``own_engine``) moved to the mode that decodes the same way on
    ``weights`` (the weights measured fastest where the server runs), where there is one: the second engine a
    burst spreads over then runs the fast weights. Returns the specs and what moved ("from -> to")."""
    out, moved = list(specs), []
    for i, spec in enumerate(out):
        if not spec.own_engine or spec.weights == weights:
            continue
        j = next((j for j, other in enumerate(out) if other.weights == weights and _like(spec, other)), None)
        if j is not None:
            out[i], out[j] = replace(spec, own_engine=False), replace(out[j], own_engine=True)
            moved.append(f"{spec.name} -> {out[j].name}")
    return out, moved


def own_engine_on_each(specs: list[ModeSpec]) -> tuple[list[ModeSpec], list[str]]:
    """``specs`` with each engine of its own (``own_engine``) given as well to every mode that decodes the same way
    on other weights (the first such mode on each): where nothing measured yet says which weights step fastest,
    each has its second engine, which the calibration measures and the predictions weigh. Returns the specs and
    the modes given one."""
    out, given = list(specs), []
    for spec in specs:
        if not spec.own_engine:
            continue
        covered = {spec.weights}
        for j, other in enumerate(out):
            if other.weights not in covered and _like(spec, other):
                out[j] = replace(other, own_engine=True)
                covered.add(other.weights)
                given.append(other.name)
    return out, given


def load_modes(*directories: Path) -> list[ModeSpec]:
    """Every ``*.yaml`` in the directories (default: ``modes/``), each sorted by file name; names must be unique."""
    modes: dict[str, ModeSpec] = {}
    for directory in directories or (DEFAULT_MODES_DIR,):
        files = sorted(Path(directory).glob("*.yaml"))
        if not files:
            raise ConfigError(f"{directory}: no mode files (*.yaml)")
        modes.update(_load_files(files, modes))
    return list(modes.values())


def _load_files(files: list[Path], known: dict[str, ModeSpec]) -> dict[str, ModeSpec]:
    modes: dict[str, ModeSpec] = {}
    for path in files:
        mode = parse_mode(load_yaml(path), str(path))
        earlier = modes.get(mode.name) or known.get(mode.name)
        if earlier is not None:
            raise ConfigError(f"{path}: mode name {mode.name!r} is already defined in {earlier.source}")
        modes[mode.name] = mode
    return modes
