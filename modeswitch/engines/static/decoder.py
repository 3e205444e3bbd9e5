"""One causal LM over one static KV cache: the three steps the owned decode loop is made of.

Modelled on gpt-fast: every forward pass has a fixed shape, so each compiles once and (on a GPU) is replayed
as a CUDA graph instead of launching each layer's kernels from Python, which is what makes eager batch-1 decode
launch-bound: launching the kernels one by one takes many times longer than reading the weights from memory, the
floor of a decode step (docs/gpu.md, "The GPU decode path").

* ``prefill``: the prompt in fixed chunks of ``chunk`` tokens (the last one padded), so prefill compiles once
  too; padded positions write garbage KV past the prompt, which the causal mask hides and the next step
  overwrites.
* ``decode``: one token.
* ``verify``: ``k + 1`` tokens (the last accepted token and ``k`` draft tokens) for speculative decoding.

The cache is transformers' ``StaticCache`` with its layers swapped for :class:`_PinnedLayer`, which writes at
the position the loop sets instead of a running count: rewinding after rejected draft tokens, or starting after
a stored prefix, is just a different start position. The model is the transformers model itself (its forward,
not a port), so every architecture transformers runs with a static cache works here.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from ...weights.presets import cache_dir

_compile_cache_lock = threading.Lock()


#: compiled variants dynamo keeps per step function: every decoder (one per mode, plus draft decoders) guards on
#: its own cache and model, three shapes each; past torch's default of 8 a step would silently run eager
RECOMPILE_LIMIT = 128


def use_compile_cache() -> str:
    """Keep Inductor's compiled kernels and FX graph cache under the project's cache directory, so a restart
    reloads them instead of compiling again (``TORCHINDUCTOR_CACHE_DIR`` set by the user wins), and let every
    decoder keep its own compiled steps."""
    with _compile_cache_lock:
        path = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit,
                                                        4 * RECOMPILE_LIMIT)
        return path


class _PinnedLayer(StaticLayer):
    """A static layer that writes new KV at ``start`` (a 0-d tensor the decoder sets inside each compiled step)
    rather than after everything written so far."""

    def __init__(self, max_cache_len: int, start: torch.Tensor) -> None:
        super().__init__(max_cache_len)
        self.start = start

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = torch.arange(key_states.shape[-2], device=self.keys.device) + self.start
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        return self.keys, self.values

    def get_seq_length(self):
        return self.start


@dataclass
class KVSnapshot:
    """KV of the first ``length`` positions, copied out of a static cache (what the prefix store keeps).

    Immutable once taken: a lookup's copy shares the tensors and only narrows ``length``, since the decoder
    copies the positions it reuses into its own cache anyway."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def __deepcopy__(self, memo) -> "KVSnapshot":
        return KVSnapshot(self.keys, self.values, self.length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class StaticDecoder:
    """A model's forward over its own static cache of ``max_len`` positions (plus slack for padded chunks and
    verify steps). Not thread-safe: one request at a time, on one thread (CUDA graph trees are per thread).

    ``compile``: ``None`` runs eager; otherwise a ``torch.compile`` mode ("reduce-overhead" on a GPU: CUDA
    graphs; "default" on a CPU). Each of the three step shapes is compiled on its first call (see
    :meth:`warm_up`)."""

    def __init__(self, model, max_len: int, *, chunk: int = 64, verify_tokens: int = 0,
                 compile: str | None = None) -> None:
        self.model = model
        self.chunk = chunk
        self.max_len = max_len
        self.device = model.device
        self.verify_tokens = verify_tokens
        #: positions the cache holds: ``max_len`` plus room for a padded prefill chunk or a verify step at its end
        self.size = size = max_len + max(chunk, verify_tokens + 1)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)
        torch._dynamo.mark_static_address(self.start)  # written inside the graph: must not move (CUDA graphs)
        self._slots = torch.arange(size, device=self.device)
        self.cache = StaticCache(config=model.config, max_cache_len=size)
        if any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            raise ValueError("the static-cache loop serves full-attention models (Llama family); this one has "
                             "sliding-window layers")
        self.cache.layers = [_PinnedLayer(size, self.start) for _ in self.cache.layers]
        self.compile = compile
        self.compiled = compile is not None
        self._lock = getattr(model, "_modeswitch_forward_lock", None) or threading.Lock()
        self._early_init(size)
        forward = self._forward
        if compile is not None:
            use_compile_cache()
            forward = torch.compile(forward, mode=compile, fullgraph=True, dynamic=False)
        self._step = forward

    def _early_init(self, size: int) -> None:
        """Allocate the cache before anything is compiled (a compiled step must find its tensors in place)."""
        config = self.model.config.get_text_config()
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = self.model.get_input_embeddings().weight.dtype
        if not dtype.is_floating_point:
            dtype = self.model.dtype
        dummy = torch.zeros((1, heads, 1, head_dim), dtype=dtype, device=self.device)
        for layer in self.cache.layers:
            layer.lazy_initialization(dummy, dummy)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.start.copy_(positions[0])
        # Which cache positions hold KV: without it transformers lets a one-token query attend to the whole
        # static cache (stale and unwritten positions too); the causal part comes from the positions.
        valid = (self._slots <= positions[-1])[None]
        out = type(self.model).forward(self.model, input_ids=ids, attention_mask=valid, position_ids=positions[None],
                                       past_key_values=self.cache, use_cache=True)
        return out.logits[0]

    @torch.inference_mode()
    def run(self, tokens: list[int], start: int) -> torch.Tensor:
        """Feed ``tokens`` at positions ``start...``; returns their logits ``[len(tokens), vocab]`` (float)."""
        n = len(tokens)
        if n == 0 or start + n > self.size:
            raise ValueError(f"{n} tokens at {start} do not fit a static cache of {self.max_len}")
        ids = torch.tensor([tokens], device=self.device)
        positions = torch.arange(start, start + n, device=self.device)
        with self._lock:
            logits = self._step(ids, positions)
        # a CUDA graph's output is overwritten by its next replay: take it out first
        return logits.float() if logits.dtype != torch.float32 else logits.clone()

    def prefill(self, tokens: list[int], start: int = 0) -> torch.Tensor:
        """Logits of the last of ``tokens`` after feeding them at ``start``: fixed chunks when compiled (one
        shape), all at once when eager (fastest without a graph)."""
        if not self.compiled:
            return self.run(tokens, start)[-1]
        logits = None
        for i in range(0, len(tokens), self.chunk):
            part = tokens[i:i + self.chunk]
            real = len(part)
            logits = self.run(part + [0] * (self.chunk - real), start + i)[real - 1]
        return logits

    def decode(self, token: int, position: int) -> torch.Tensor:
        return self.run([token], position)[0]

    def verify(self, tokens: list[int], position: int) -> torch.Tensor:
        """Logits after each of ``tokens`` (the last accepted token, then ``verify_tokens`` drafts)."""
        return self.run(tokens, position)

    def snapshot(self, length: int) -> KVSnapshot:
        """A copy of the KV of positions ``[0, length)``."""
        layers = self.cache.layers
        return KVSnapshot([l.keys[:, :, :length].clone() for l in layers],
                          [l.values[:, :, :length].clone() for l in layers], length)

    def load(self, snap: KVSnapshot) -> int:
        """Copy a snapshot's positions into this cache; returns how many."""
        n = snap.length
        with torch.inference_mode():
            for layer, k, v in zip(self.cache.layers, snap.keys, snap.values):
                layer.keys[:, :, :n].copy_(k[:, :, :n])
                layer.values[:, :, :n].copy_(v[:, :, :n])
        return n

    def warm_up(self) -> float:
        """Run (and so compile) every step shape this decoder uses; returns the seconds it took."""
        started = time.perf_counter()
        for _ in range(3 if self.device.type == "cuda" else 1):  # CUDA graph trees record on a later call
            self.prefill([0] * min(self.chunk, 8))
            self.decode(0, 8)
            if self.verify_tokens:
                self.verify([0] * (self.verify_tokens + 1), 8)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started
