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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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


_compiled: dict[tuple, tuple] = {}


def launch(variant: Variant, grid: tuple[int, ...], args: tuple) -> None:
    """``kernel[grid](*args, **constants, **options)`` of the variant; ``args`` are the runtime
    arguments in order, all before the constexpr ones."""
    key = (variant, _specialization(args))
    hit = _compiled.get(key)
    hook = knobs.runtime.launch_enter_hook  # a chain of hooks, or one
    if hit is None or (hook is not None and getattr(hook, "calls", True)):
        kernel = variant.kernel
        compiled = kernel[grid](*args, **variant.constants, **variant.options)
        if hasattr(compiled, "result"):  # compiled in the background
            compiled = compiled.result()
        if hasattr(compiled, "packed_metadata"):  # not the interpreter's
            tail = tuple(variant.constants[name] if name in variant.constants else param.default
                         for name, param in zip(kernel.arg_names[len(args):], kernel.params[len(args):]))
            _compiled[key] = (compiled, tail)
        return
    compiled, tail = hit
    current_stream, current_device = _stream_getters()
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 current_stream(current_device()), compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)


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
