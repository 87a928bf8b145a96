"""Launching compiled Triton kernels without the JIT's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument at each call: on the
H200 machine's host, 28 us for the decode kernel's 37 arguments, against 8.5 us through the
compiled kernel's own launcher. Outside CUDA graphs (every step that carries a prompt) a layer
launches three or four of our kernels, so the host fell behind the GPU.

``launch`` compiles a variant through the JIT on first use and keeps it under the variant (its
compile-time constants and options) and what Triton specializes runtime arguments on: a tensor's
dtype and 16-byte alignment, an int's being 1 or a multiple of 16. Later calls with the same key
go to the compiled kernel directly. Under Triton's interpreter (CPU tests), or with a launch hook
set (a profiler), every call is a plain JIT launch.

``launch`` returns the compiled kernel it ran (``Compiled``), so that a caller who launches it
again with the same arguments but a few pointers (a step's layers) can keep the argument list and
skip even the specialization (``decode.paged_decode``'s plans).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from triton import knobs
from triton.runtime import driver


@dataclass(frozen=True, eq=False)  # compared by identity: build each one once (functools.cache)
class Variant:
    kernel: object    # a @triton.jit function
    constants: dict   # its constexpr arguments by name
    options: dict     # num_warps, num_stages, ...


def _specialization(args: tuple) -> tuple:
    return tuple([(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
                  else (a == 1, a & 15 == 0) if isinstance(a, int) else None for a in args])


_compiled: dict[tuple, Compiled] = {}  # by variant and specialization


def hooked() -> bool:
    """Whether a launch hook (a profiler) is set: then every launch goes through the JIT, which calls it."""
    hook = knobs.runtime.launch_enter_hook  # a chain of hooks, or one
    return hook is not None and getattr(hook, "calls", True)


class Compiled(NamedTuple):
    """A variant compiled for one specialization of its runtime arguments, launched with them all
    given as plain values (pointers as integers, which the launcher takes without looking them up)."""
    kernel: object   # Triton's compiled kernel
    tail: tuple      # the constexpr arguments' values, after the runtime ones

    def run(self, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
        k = self.kernel
        k.run(*grid, stream, k.function, k.packed_metadata, None, None, None, *args, *self.tail)


def launch(variant: Variant, grid: tuple[int, ...], args: tuple) -> Compiled | None:
    """``kernel[grid](*args, **constants, **options)`` of the variant; ``args`` are the runtime
    arguments in order, all before the constexpr ones. Returns the compiled kernel it ran, for
    launches with these arguments' specialization (``Compiled.run``), or None where calls go
    through the JIT (the interpreter, a launch hook)."""
    key = (variant, _specialization(args))
    hit = _compiled.get(key)
    jit_only = hooked()
    if hit is None or jit_only:
        kernel = variant.kernel
        compiled = kernel[grid](*args, **variant.constants, **variant.options)
        if hasattr(compiled, "result"):  # compiled in the background
            compiled = compiled.result()
        if not hasattr(compiled, "packed_metadata"):  # the interpreter's
            return None
        hit = _compiled[key] = Compiled(compiled, tuple(
            variant.constants[name] if name in variant.constants else param.default
            for name, param in zip(kernel.arg_names[len(args):], kernel.params[len(args):])))
        return None if jit_only else hit
    current_stream, current_device = _stream_getters()
    hit.run((tuple(grid) + (1, 1))[:3], current_stream(current_device()), args)
    return hit


def plannable(device: torch.device) -> bool:
    """Whether a step's launches may be planned (``Compiled.run`` kept across its layers): where they
    are compiled, on CUDA, with no launch hook (``hooked``)."""
    return device.type == "cuda" and not hooked()


def device_index(device: torch.device) -> int:
    """A CUDA device's index, the current device's where ``device`` names none."""
    return torch.cuda.current_device() if device.index is None else device.index


def stream_handle(device: torch.device) -> int:
    """The handle of ``device``'s current CUDA stream, got as Triton's launcher gets it: a third of
    ``torch.cuda.current_stream(device).cuda_stream``'s host time, which builds a Stream object."""
    current_stream, _ = _stream_getters()
    return current_stream(device_index(device))


@functools.cache
def _stream_getters():
    """Bound on first use: the CPU (interpreter) has no GPU driver."""
    return driver.active.get_current_stream, driver.active.get_current_device
