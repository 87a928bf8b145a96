"""Launch plans kept across a step's layers.

A step's layers launch each kernel with the same rows, lengths and page format and differ only in
a few pointers (query, cache, output). Outside CUDA graphs (every step that carries a prompt) the
host launches every layer's kernels, and on some machines the GPU waits for it. So a kernel's
arguments are worked out once a step and kept, as FlashInfer splits plan from run: a layer's call
then only sets its own pointers (the CUDA kernels: in a ctypes struct; the Triton decode: in the
compiled kernel's argument list).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable


class LaunchPlans:
    """Plans kept by every value they come from, so a hit is exact: a key holds pointers, not
    tensors, and a plan holds nothing the key does not determine. The oldest plans go past
    ``limit``."""

    def __init__(self, limit: int = 256) -> None:
        self._plans: dict[Hashable, object] = {}
        self._limit = limit

    def find(self, key: Hashable):
        """The plan kept under ``key``, or None."""
        return self._plans.get(key)

    def keep(self, key: Hashable, plan: object) -> None:
        if len(self._plans) >= self._limit:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = plan

    def get(self, key: Hashable, make: Callable[[], object]):
        """The plan under ``key``, made (``make()``) and kept if there is none."""
        plan = self._plans.get(key)
        if plan is None:
            plan = make()
            self.keep(key, plan)
        return plan
