"""Sampling one token the way vLLM's sampler does on a CPU, so that a seed gives the transformers engine the texts
``vllm serve`` gives.

vLLM's v1 sampler on x86 and Arm CPUs (``TopKTopPSampler.forward_cpu``, ``vllm/v1/sample/ops/topk_topp_sampler.py``)
draws no noise tensor. For each sampled position it takes one integer, ``randint(0, 2**31)``, from the request's
generator (a CPU ``torch.Generator`` given ``manual_seed(seed)`` when the request has a seed), and hands it with the
processed float32 logits (after temperature, ``min_p``, top-k and top-p, the tokens they remove at -inf) to its C++
kernel ``fused_gumbel_argmax``: the token is ``argmax_i(logit_i + g_i)``, computed in float64, where the Gumbel
noise ``g_i = -log(-log(u_i))`` comes from a 53-bit uniform ``u_i`` hashed from the integer and the token id ``i``
by SplitMix64. Since the noise is a hash of (integer, token id), it is the same whatever else is in the batch.

:func:`step_seed` and :func:`gumbel_argmax` do the same with torch; ``tests/e2e/test_openai_params.py`` holds them to
vLLM's own kernel and sampler.
"""

from __future__ import annotations

import torch

#: the exclusive bound of the integer vLLM draws from a request's generator per sampled position
SEED_BOUND = 2 ** 31
#: SplitMix64's constants: the increment between the hashed token ids, and the two multipliers of its mix
_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
#: the noise from a 53-bit uniform lies in [-3.62, 37.43], so a token more than 41.05 below the largest logit never
#: wins: only the tokens within this reach are hashed (the argmax is the same, the work smaller)
_REACH = 42.0


def _int64(x: int) -> int:
    """A uint64 constant as the int64 torch stores its bits in."""
    return x - (1 << 64) if x >> 63 else x


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors that hold uint64 bits (torch's ``>>`` keeps the sign)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors; torch's int64 products wrap as uint64 ones do."""
    z = (z ^ _shr(z, 30)) * _int64(_MIX1)
    z = (z ^ _shr(z, 27)) * _int64(_MIX2)
    return z ^ _shr(z, 31)


def step_seed(generator: torch.Generator) -> int:
    """The integer vLLM's CPU sampler draws from a request's generator for each position it samples."""
    return int(torch.randint(0, SEED_BOUND, (1,), generator=generator, dtype=torch.long))


def gumbel_argmax(logits: torch.Tensor, seed: int) -> int:
    """The token vLLM's ``fused_gumbel_argmax`` picks from one row of processed logits with the integer ``seed``:
    ``argmax(logit + g)`` in float64, ``g`` hashed from ``seed`` and each token id (a row all -inf gives 0)."""
    row = logits.detach().to("cpu", torch.float32)
    ids = (row >= row.max() - _REACH).nonzero()[:, 0]
    key = _mix(torch.tensor([seed], dtype=torch.int64))
    bits = _shr(_mix(key + (ids + 1) * _int64(_GAMMA)), 11)
    u = (bits.double() + 0.5) * 2.0 ** -53
    return int(ids[(row[ids].double() - torch.log(-torch.log(u))).argmax()])
