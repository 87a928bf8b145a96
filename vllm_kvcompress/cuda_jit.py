"""What the CUDA kernels (``csrc/``) share: a build with the page formats' constants as flags,
loaded through ctypes. A library prebuilt for these very sources and flags (``prebuild``, shipped in
``csrc/prebuilt/``) is loaded as it is, so a machine without nvcc runs the CUDA kernels too; else a
just-in-time build with nvcc through ``torch.utils.cpp_extension`` (no torch headers: seconds,
cached by torch under ``TORCH_EXTENSIONS_DIR``). Which kernel serves a format is the kernel
registry's to say (``kernels.registry``)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import logging
import time
from pathlib import Path


CSRC = Path(importlib.import_module("vllm_kvcompress.csrc").__path__[0])  # csrc/, installed as this package
# The CUDA kernels' libraries and their sources: what the loaders build and ``prebuild`` ships.
LIBRARIES = {"kvcompress_decode": "decode_kernel.cu", "kvcompress_write": "write_kernel.cu",
             "kvcompress_salient_write": "salient_write_kernel.cu",
             "kvcompress_salient_decode": "salient_decode_kernel.cu",
             "kvcompress_salient_rows_write": "salient_rows_write_kernel.cu"}
# Prebuilt machine code for compute capabilities 8.0 (A100), 8.6, 8.9 (L4, L40) and 9.0 (H100, H200),
# and PTX of 9.0 that the driver compiles for later GPUs.
PREBUILT_ARCHS = ("80", "86", "89", "90")
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


def prebuilt_path(name: str, source: str) -> Path:
    """Where ``prebuild`` puts ``csrc/source``'s library: the name carries a digest of the source and
    the flags (headers and page constants included), so a library of other sources is never loaded."""
    digest = hashlib.sha256((CSRC / source).read_bytes() + "\0".join(build_flags()).encode()).hexdigest()[:16]
    return CSRC / "prebuilt" / f"{name}-{digest}.so"


def prebuilt_available() -> bool:
    """Whether every CUDA kernel's library is prebuilt for these sources."""
    return all(prebuilt_path(name, source).exists() for name, source in LIBRARIES.items())


def load(name: str, source: str, variable: str) -> ctypes.CDLL:
    """Load ``csrc/source``'s prebuilt library, or build (or load the cached build of) it as a shared
    library named ``name``: at startup, not in the middle of serving; a failed build names
    ``variable``'s way around it."""
    prebuilt = prebuilt_path(name, source) if LIBRARIES.get(name) == source else None
    if prebuilt is not None and prebuilt.exists():
        logger.info("kv-compression: %s prebuilt (%s)", source, prebuilt.name)
        return ctypes.CDLL(str(prebuilt))
    from torch.utils.cpp_extension import load as build
    _clear_stale_lock(name)
    try:
        path = build(name=name, sources=[str(CSRC / source)], extra_cuda_cflags=build_flags(),
                     is_python_module=False, verbose=False)
    except Exception as e:
        raise RuntimeError(f"{source} did not build ({e}); {variable}=triton uses the Triton kernel instead") from e
    return ctypes.CDLL(path)


class Kernel:
    """A CUDA library's launch function, ``int symbol(const Args*)`` returning a cudaError_t: loaded at
    startup (``build``) or at its first launch, each launch given its arguments' struct; a failed
    launch raises, naming ``what``."""

    def __init__(self, library: str, symbol: str, args_type: type[ctypes.Structure], variable: str, what: str):
        self.library, self.symbol, self.args_type, self.variable, self.what = library, symbol, args_type, variable, what

    @functools.cached_property
    def _function(self):
        function = getattr(load(self.library, LIBRARIES[self.library], self.variable), self.symbol)
        function.argtypes = [ctypes.POINTER(self.args_type)]
        function.restype = ctypes.c_int
        return function

    def build(self) -> None:
        """Build (or load the cached build of) the library: at startup, not in the middle of serving."""
        self._function

    def __call__(self, args: ctypes.Structure) -> None:
        err = self._function(ctypes.byref(args))
        if err:
            raise RuntimeError(f"{self.what} launch failed: cudaError {err}")


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


def _nvcc() -> str:
    """nvcc's path, from CUDA_HOME or PATH (torch's CUDA_HOME is None in a CPU build of torch: a
    wheel's builder may have nvcc without a GPU)."""
    import os
    import shutil

    home = os.environ.get("CUDA_HOME")
    nvcc = (shutil.which("nvcc", path=f"{home}/bin") if home else None) or shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("no nvcc: put a CUDA toolkit's nvcc on PATH, or set CUDA_HOME, to build the CUDA kernels")
    return nvcc


def build_library(source: Path, out: Path, archs: tuple[str, ...]) -> Path:
    """Build ``source`` into the shared library ``out`` with nvcc: machine code for ``archs`` and PTX of
    the last, the CUDA runtime linked in statically, the just-in-time build's flags, ``csrc/``'s headers
    (a source elsewhere, such as a variant timed beside the served one, finds them too)."""
    import subprocess

    codes = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs] + [
        f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    subprocess.run([_nvcc(), "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "--expt-relaxed-constexpr", "-cudart",
                    "static", *codes, *build_flags(), f"-I{CSRC}", "-o", str(out), str(source)], check=True)
    return out


def prebuild(archs: tuple[str, ...] = PREBUILT_ARCHS, libraries: dict[str, str] | None = None) -> list[Path]:
    """Build the CUDA kernels' libraries into ``csrc/prebuilt/`` (``build_library``, one at a time, a
    progress bar over them). Removes older builds of the same libraries."""
    from tqdm import tqdm

    _nvcc()  # before the older builds are removed
    out = CSRC / "prebuilt"
    out.mkdir(exist_ok=True)
    built = []
    for name, source in tqdm((libraries or LIBRARIES).items(), desc="prebuilding CUDA kernels", unit="library"):
        path = prebuilt_path(name, source)
        for old in out.glob(f"{name}-*.so"):
            old.unlink()
        built.append(build_library(CSRC / source, path, archs))
    return built
