"""The environment switches that steer which kernels run, read and checked once per process.

    KVCOMPRESS_KERNELS=torch           every operation through the torch reference (for checking)
    KVCOMPRESS_DECODE=auto|triton|cuda decode rows: the CUDA kernel where it serves the format
                                       (auto), never (triton), or required (cuda: refused where it cannot)
    KVCOMPRESS_WRITE=auto|triton|cuda  the cache write, likewise

Nothing else in the package reads ``KVCOMPRESS_*``; the kernel registry takes a ``KernelPolicy``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .config import KVCompressionConfigError

KERNELS = "KVCOMPRESS_KERNELS"
DECODE = "KVCOMPRESS_DECODE"
WRITE = "KVCOMPRESS_WRITE"
MODES = ("auto", "triton", "cuda")


class PolicyError(KVCompressionConfigError):
    """A ``KVCOMPRESS_*`` value that names nothing, or asks for a kernel that cannot serve: refused at
    startup like a bad config."""


@dataclass(frozen=True)
class KernelPolicy:
    reference_only: bool = False  # KVCOMPRESS_KERNELS=torch
    decode: str = "auto"          # KVCOMPRESS_DECODE
    write: str = "auto"           # KVCOMPRESS_WRITE

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> "KernelPolicy":
        kernels = env.get(KERNELS, "")
        if kernels not in ("", "torch"):
            raise PolicyError(f"{KERNELS}={kernels!r}: allowed are 'torch' (the torch reference for every "
                              "operation) or unset (the kernels)")
        modes = {}
        for variable, kernel in ((DECODE, "decode"), (WRITE, "write")):
            mode = env.get(variable, "auto")
            if mode not in MODES:
                raise PolicyError(f"{variable}={mode!r}: allowed are 'auto' (the default: the CUDA {kernel} kernel "
                                  "where it covers the format and nvcc exists, else the Triton one), 'triton' and "
                                  "'cuda'")
            modes[kernel] = mode
        return cls(kernels == "torch", **modes)

    def mode(self, operation: str) -> str:
        """``auto``, ``triton`` or ``cuda`` for an operation the switches name (others: ``auto``)."""
        return {"decode": self.decode, "write": self.write}.get(operation, "auto")

    @staticmethod
    def variable(operation: str) -> str:
        return {"decode": DECODE, "write": WRITE}[operation]


@functools.cache
def current() -> KernelPolicy:
    """This process's policy, read from the environment on first use."""
    return KernelPolicy.from_environment()
