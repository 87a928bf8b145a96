"""Compile Triton kernels for an H100 (sm_90) on any machine, in a process of their own, as far as
the front end.

The CPU suite runs kernels in Triton's interpreter, which takes them as Python and lets through
what the compiler refuses (a loop-carried value whose type a branch changes); compiling them here
catches that before a GPU does.
"""

import os
import subprocess
import sys

import pytest

_PRELUDE = '''
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend


def compile_for_h100(kernel, runtime, constants):
    """The compiler's front end (Python to Triton IR, where types are checked) for sm_90; the back
    end's passes depend on the Triton version and run on the GPU. ``runtime``: the types of the
    arguments that are not constants (e.g. "*bf16", "i32")."""
    signature = {name: runtime.get(name, "constexpr") for name in kernel.arg_names}
    fixed = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    ASTSource(fn=kernel, signature=signature, constexprs=fixed).make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
'''


def compiles_for_h100(script: str) -> None:
    """Run ``script`` (which calls ``compile_for_h100``) with the compiler, not the interpreter."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    run = subprocess.run([sys.executable, "-c", _PRELUDE + script], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
