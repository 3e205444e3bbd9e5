"""Ray's own prefix-aware router, the baseline the ModeSwitch router is measured against.

A module of its own because ``ray.serve.llm`` is heavy to import and only this baseline needs it."""

from __future__ import annotations

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.llm.request_router import PrefixCacheAffinityRouter

from .routing import Pinning, forwarded


class PrefixAffinityBaseline(Pinning, PrefixCacheAffinityRouter):
    """``PrefixCacheAffinityRouter`` unchanged (it reads :attr:`~modeswitch.cluster.wire.Forwarded.prompt`),
    plus the pinning every router here honours."""

    async def place(self, candidates, pending):
        req = forwarded(pending)
        if req is None or not req.prompt:  # it divides by the prompt's length: no text, no prefix to match
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidates, pending)
        return await PrefixCacheAffinityRouter.choose_replicas(self, candidates, pending)
