"""The memory planner: what every mode keeps resident, checked against a budget before anything loads.

Weights are counted once per holder (modes that share a variant share the copy; a vLLM engine holds its
own); each mode adds the KV memory it reserves: one sequence of ``max_model_len`` tokens for batch-1 modes,
plus the stored-prefix capacity for prefix-cache modes, the paged block pool for continuous batching, and
the draft model's KV for speculative modes. Modes that share one KV pool (a vLLM engine's) share it: the pool
holds the largest of their reservations. What the runtimes cost beyond weights and KV is counted too: the server
process as measured when the plan is made, and each engine process the backend starts. Sizes are computed from
the model config on the meta device (no weights loaded), so a mode set that does not fit is refused at start
with every mode's size in the message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .weight_kinds import KINDS, REFERENCE, LinearShape

GIB = 2**30
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": GIB, "gb": 10**9, "gib": GIB, "t": 2**40, "tb": 10**12, "tib": 2**40}


class MemoryBudgetExceeded(RuntimeError):
    """The selected modes need more memory than the budget allows."""


def parse_bytes(text: str) -> int:
    """``"12GiB"``, ``"800MB"``, ``"1.5g"`` or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (examples: 8GiB, 800MB, 1.5g)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 4 else f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts that decide weight sizes, and the KV size of one token."""

    linear_params: int          # in the decoder layers' linear projections (what GPTQ / INT8 quantize)
    linear_in_features: int     # summed input widths of those layers (for per-group scales)
    linear_out_features: int    # summed output widths (per-row scales)
    other_params: int           # embeddings, norms, lm_head: kept in the reference dtype
    kv_bytes_per_token: int     # at the reference dtype
    head_params: int = 0        # lm_head (vocab x hidden): multiplied through once per token, like the linears
    attn_width: int = 0         # layers x attention heads x head_dim (attention FLOPs per query-key pair / 4)

    @property
    def matmul_params(self) -> int:
        """Weights each token is multiplied through: 2 x this is the FLOPs per token outside attention."""
        return self.linear_params + self.head_params

    @classmethod
    def from_config(cls, config, dtype_bytes: int) -> "ModelShape":
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        linear = [m for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"]
        linear_params = sum(m.weight.numel() for m in linear)
        total = sum(p.numel() for p in model.parameters())  # tied weights are counted once
        text = config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(
            linear_params=linear_params,
            linear_in_features=sum(m.in_features for m in linear),
            linear_out_features=sum(m.out_features for m in linear),
            other_params=total - linear_params,
            kv_bytes_per_token=2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes,
            head_params=text.vocab_size * text.hidden_size,
            attn_width=text.num_hidden_layers * text.num_attention_heads * head_dim,
        )

    def weights_bytes(self, variant: str, dtype_bytes: int, group_size: int = 64) -> int:
        """Resident bytes of ``variant``: its kind's linear layers, everything else in the reference dtype (a
        variant that is no kind, a draft model, is dense)."""
        linear = LinearShape(self.linear_params, self.linear_in_features, self.linear_out_features)
        linears = KINDS.get(variant, REFERENCE).linear_bytes(linear, dtype_bytes, group_size)
        return linears + self.other_params * dtype_bytes


@dataclass
class Footprint:
    """What one mode keeps resident: the weights it runs on (by holder: a variant, or an engine that holds
    its own copy), any further weights it keeps (a draft model), and its KV reservation."""

    mode: str
    weights: str
    kv_bytes: int
    kv_detail: str
    #: every weights holder the mode needs -> its bytes (``weights`` first, then e.g. the draft's)
    weights_bytes: dict[str, int] = field(default_factory=dict)
    #: the KV pool the reservation lives in: modes naming one pool share it (one vLLM engine schedules every mode
    #: on it from one pool, and queues what does not fit), so it holds the largest of them; "": the mode's own
    kv_pool: str = ""
    #: what a holder costs beyond its weights and KV (an engine's process: its runtime's heap, arenas, compiled
    #: graphs), counted once per holder
    runtime_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class MemoryPlan:
    budget: int
    weights: dict[str, int]                              # holder -> bytes (counted once)
    users: dict[str, list[str]] = field(default_factory=dict)  # holder -> modes sharing it
    footprints: list[Footprint] = field(default_factory=list)
    #: holder -> what its process or runtime costs beyond weights and KV
    runtime: dict[str, int] = field(default_factory=dict)
    #: what this process holds when the plan is made, where the models live in its memory (a CPU): part of the
    #: footprint, not of what the budget must still fit (free memory is measured with it already taken)
    server_bytes: int = 0

    def add(self, footprint: Footprint) -> None:
        """Count a mode in: its KV, and each weights holder and runtime once however many modes share it."""
        for holder, size in footprint.weights_bytes.items():
            self.weights.setdefault(holder, size)
            self.users.setdefault(holder, []).append(footprint.mode)
        for holder, size in footprint.runtime_bytes.items():
            self.runtime.setdefault(holder, size)
        self.footprints.append(footprint)

    @property
    def pools(self) -> dict[str, int]:
        """KV pool -> the bytes it reserves: the largest reservation of the modes in it."""
        out: dict[str, int] = {}
        for f in self.footprints:
            pool = f.kv_pool or f.mode
            out[pool] = max(out.get(pool, 0), f.kv_bytes)
        return out

    @property
    def kv_total(self) -> int:
        return sum(self.pools.values())

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.kv_total + sum(self.runtime.values()) + self.server_bytes

    @property
    def to_load(self) -> int:
        """What the modes add to what this process already holds: what the budget must fit."""
        return self.total - self.server_bytes

    def holder_bytes(self, holder: str) -> int:
        """What one holder (a vLLM engine) is planned to hold: its weights, its KV pool, its runtime."""
        return self.weights.get(holder, 0) + self.pools.get(holder, 0) + self.runtime.get(holder, 0)

    def describe(self) -> str:
        lines = [f"  weights {v}: {fmt(b)} (shared by {', '.join(self.users.get(v, []))})"
                 for v, b in self.weights.items()]
        lines += [f"  mode {f.mode}: KV {fmt(f.kv_bytes)} ({f.kv_detail})" +
                  (f" in the pool of {f.kv_pool} ({fmt(self.pools[f.kv_pool])})" if f.kv_pool else "")
                  for f in self.footprints]
        lines += [f"  runtime {holder}: {fmt(b)}" for holder, b in self.runtime.items()]
        if self.server_bytes:
            lines.append(f"  this process, already resident: {fmt(self.server_bytes)}")
        return "\n".join(lines + [f"  to load {fmt(self.to_load)} of a budget of {fmt(self.budget)}"])

    def check(self) -> None:
        if self.to_load > self.budget:
            raise MemoryBudgetExceeded(
                f"the selected modes need {fmt(self.to_load)} but the memory budget is {fmt(self.budget)}:\n"
                f"{self.describe()}\nload fewer modes (--modes a,b,...) or raise --memory-budget")

    def mode_bytes(self, mode: str) -> dict:
        fp = next(f for f in self.footprints if f.mode == mode)
        return {"weights_variant": fp.weights, "weights_bytes": self.weights.get(fp.weights, 0),
                "weights_shared_with": [m for m in self.users.get(fp.weights, []) if m != mode],
                "kv_bytes": fp.kv_bytes, **({"kv_pool": fp.kv_pool} if fp.kv_pool else {})}
