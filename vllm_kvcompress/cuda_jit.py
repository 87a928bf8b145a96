"""What the CUDA kernels (``csrc/``) share: an environment variable that chooses between a CUDA
kernel and its Triton counterpart, a just-in-time build with nvcc through
``torch.utils.cpp_extension`` (no torch headers: seconds, cached by torch under
``TORCH_EXTENSIONS_DIR``) loaded through ctypes."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

CSRC = Path(importlib.import_module("vllm_kvcompress.csrc").__path__[0])  # csrc/, installed as this package
MODES = ("auto", "triton", "cuda")
# A build takes far less; an older lock file in the build directory was left by a process killed
# in the middle of a build, and torch would wait for it forever: the engine would hang at startup.
STALE_LOCK_S = 600
logger = logging.getLogger("vllm.kvcompress")


def nvcc_available() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME
    return CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").exists()


def check_mode(variable: str, mode: str, kernel: str) -> None:
    """``mode`` is the value of ``variable``, which picks the ``kernel`` kernel ("decode", "write")."""
    if mode not in MODES:
        raise ValueError(f"{variable}={mode!r}: allowed are 'auto' (the default: the CUDA {kernel} kernel where it "
                         "covers the format and nvcc exists, else the Triton one), 'triton' and 'cuda'")


def choose(variable: str, mode: str, kernel: str, why_not: Callable[[], str | None]) -> str | None:
    """Under ``variable=mode``: None if the CUDA kernel is used, else why the Triton one is.
    ``why_not`` says why the CUDA kernel cannot serve (None: it can); a ROCm build of torch or no
    nvcc rule it out too. ``cuda`` where it cannot be used is refused."""
    check_mode(variable, mode, kernel)
    if mode == "triton":
        return f"{variable}=triton"
    why = (why_not() or ("not an NVIDIA GPU" if torch.version.hip is not None else None)
           or (None if nvcc_available() else "no nvcc (set CUDA_HOME to a CUDA toolkit)"))
    if why is not None and mode == "cuda":
        raise ValueError(f"{variable}=cuda: the CUDA {kernel} kernel cannot be used: {why}; "
                         "allowed: 'auto' or 'triton' (the Triton kernel)")
    return why


@functools.cache
def triton_kernels(name: str):
    """``vllm_kvcompress.triton_kernels.name``, imported at a kernel's first launch rather than with
    the CUDA kernels' modules: importing Triton reads TRITON_INTERPRET, which the CPU tests set
    before they import the Triton kernels."""
    return importlib.import_module(f"vllm_kvcompress.triton_kernels.{name}")


def headers_digest() -> str:
    """A digest of ``csrc/*.cuh``: torch's build cache hashes the sources it is given, not the headers
    they include, so the digest goes into the build's flags and a changed header rebuilds."""
    digest = hashlib.sha256()
    for header in sorted(CSRC.glob("*.cuh")):
        digest.update(header.name.encode() + header.read_bytes())
    return digest.hexdigest()[:16]


def load(name: str, source: str, variable: str) -> ctypes.CDLL:
    """Build (or load the cached build of) ``csrc/source`` as a shared library named ``name``: at
    startup, not in the middle of serving; a failed build names ``variable``'s way around it."""
    from torch.utils.cpp_extension import load as build
    _clear_stale_lock(name)
    try:
        path = build(name=name, sources=[str(CSRC / source)],
                     extra_cuda_cflags=["-O3", f"-DKVC_HEADERS={headers_digest()}"], is_python_module=False,
                     verbose=False)
    except Exception as e:
        raise RuntimeError(f"{source} did not build ({e}); {variable}=triton uses the Triton kernel instead") from e
    return ctypes.CDLL(path)


def _clear_stale_lock(name: str) -> None:
    """Remove the build directory's lock file where it is older than STALE_LOCK_S; say so where a
    younger one makes this process wait for another's build."""
    from torch.utils.cpp_extension import _get_build_directory  # where torch's load() builds ``name``
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("kv-compression: removing %s, left %.0f s ago by a build of %s that did not finish", lock, age,
                       name)
        lock.unlink(missing_ok=True)
    else:
        logger.info("kv-compression: waiting for another process's build of %s (its lock: %s)", name, lock)
