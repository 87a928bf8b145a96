"""What the CUDA kernels (``csrc/``) share: a just-in-time build with nvcc through
``torch.utils.cpp_extension`` (no torch headers: seconds, cached by torch under
``TORCH_EXTENSIONS_DIR``) with the page formats' constants as flags, loaded through ctypes. Which
kernel serves a format is the kernel registry's to say (``kernels.registry``)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import logging
import time
from pathlib import Path


CSRC = Path(importlib.import_module("vllm_kvcompress.csrc").__path__[0])  # csrc/, installed as this package
# A build takes far less; an older lock file in the build directory was left by a process killed
# in the middle of a build, and torch would wait for it forever: the engine would hang at startup.
STALE_LOCK_S = 600
logger = logging.getLogger("vllm.kvcompress")


def nvcc_available() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME
    return CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").exists()


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


def build_flags() -> list[str]:
    """nvcc's flags: the header digest, and every constant the sources share with the page formats
    (``formats.KERNEL_CONSTANTS``), so that no source states a layout value of its own."""
    from .formats import KERNEL_CONSTANTS
    return ["-O3", f"-DKVC_HEADERS={headers_digest()}", *(f"-D{k}={v!r}" for k, v in KERNEL_CONSTANTS.items())]


def load(name: str, source: str, variable: str) -> ctypes.CDLL:
    """Build (or load the cached build of) ``csrc/source`` as a shared library named ``name``: at
    startup, not in the middle of serving; a failed build names ``variable``'s way around it."""
    from torch.utils.cpp_extension import load as build
    _clear_stale_lock(name)
    try:
        path = build(name=name, sources=[str(CSRC / source)], extra_cuda_cflags=build_flags(),
                     is_python_module=False, verbose=False)
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
