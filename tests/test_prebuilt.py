"""CUDA kernels prebuilt into the package (``kvcompress prebuild-cuda``): loaded without nvcc, never
for other sources than they were built from, and planned by the registry where there is no nvcc.

The build needs nvcc (not a GPU); it is skipped where there is none."""

import ctypes
import shutil

import pytest
import torch

from vllm_kvcompress import cuda_jit
from vllm_kvcompress.config import LayerFormat
from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.kernels import registry
from vllm_kvcompress.kernels.registry import KernelPolicy

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to prebuild with")
FOUR = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), torch.bfloat16, 128, 8, 128)


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch):
    """csrc/ copied, so that a prebuild writes into the copy and not into the checkout."""
    copy = tmp_path / "csrc"
    shutil.copytree(cuda_jit.CSRC, copy, ignore=shutil.ignore_patterns("prebuilt", "__pycache__"))
    monkeypatch.setattr(cuda_jit, "CSRC", copy)
    return copy


@needs_nvcc
def test_prebuilt_library_loads_without_a_build_and_only_for_its_sources(csrc_copy, monkeypatch):
    import torch.utils.cpp_extension

    (path,) = cuda_jit.prebuild(("90",), {"kvcompress_write": "write_kernel.cu"})
    assert path.parent == csrc_copy / "prebuilt" and path == cuda_jit.prebuilt_path("kvcompress_write", "write_kernel.cu")

    def no_build(**kw):
        raise OSError("no nvcc")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    lib = cuda_jit.load("kvcompress_write", "write_kernel.cu", "KVCOMPRESS_WRITE")
    assert isinstance(lib, ctypes.CDLL) and hasattr(lib, "kvc_write")
    # launched through cuda_jit.Kernel, as cuda_write launches it: a launch the library refuses (an
    # all-zero argument struct: no dtype it covers) raises with CUDA's error, with or without a GPU
    from vllm_kvcompress import cuda_write
    k = cuda_write._kernel  # its fields, on a fresh Kernel that loads the copy's library
    kernel = cuda_jit.Kernel(k.library, k.symbol, k.args_type, k.variable, k.what)
    with pytest.raises(RuntimeError, match=r"^CUDA write kernel launch failed: cudaError 1$"):  # cudaErrorInvalidValue
        kernel(cuda_write._WriteArgs())
    # an edited header (or source, or page constant) names another library: the old one is not loaded
    header = next(csrc_copy.glob("*.cuh"))
    header.write_bytes(header.read_bytes() + b"\n// edited\n")
    assert not cuda_jit.prebuilt_path("kvcompress_write", "write_kernel.cu").exists()
    with pytest.raises(RuntimeError, match="write_kernel.cu did not build .* KVCOMPRESS_WRITE=triton"):
        cuda_jit.load("kvcompress_write", "write_kernel.cu", "KVCOMPRESS_WRITE")


def test_prebuilt_available_needs_every_library(csrc_copy):
    (csrc_copy / "prebuilt").mkdir()
    for name, source in list(cuda_jit.LIBRARIES.items())[:-1]:
        cuda_jit.prebuilt_path(name, source).touch()
    assert not cuda_jit.prebuilt_available()
    name, source = list(cuda_jit.LIBRARIES.items())[-1]
    cuda_jit.prebuilt_path(name, source).touch()
    assert cuda_jit.prebuilt_available()


@pytest.mark.parametrize("device, expected, why", [
    (registry.Device("cuda", (9, 0), prebuilt=True), "cuda", None),
    (registry.Device("cuda", (9, 0)), "triton", "no nvcc (set CUDA_HOME to a CUDA toolkit) and no prebuilt kernels"),
    (registry.Device("cuda", (7, 5), prebuilt=True), "triton",
     "the prebuilt kernels need compute capability 8.0 or later (this GPU: 7.5)"),
])
def test_registry_plans_the_cuda_kernels_where_they_are_prebuilt(device, expected, why):
    """Without nvcc the prebuilt kernels serve on the GPUs they were built for (8.0 and later)."""
    ctx = registry.LayerContext(device, torch.bfloat16, 8)
    plan = registry.plan(FOUR, ctx, KernelPolicy())
    assert plan.write.name == expected
    if why is not None:
        assert why in plan.write.describe()


@needs_nvcc
def test_variants_outside_csrc_build_with_the_served_flags(tmp_path):
    """``benchmarks/experiments/salient_write_ab.py`` builds variant sources of a kernel from anywhere
    (``cuda_jit.build_library``: csrc's headers and the page constants found), each loaded with its own
    launch function."""
    from benchmarks.experiments.salient_write_ab import build_variants
    from vllm_kvcompress import cuda_salient_write

    served = cuda_jit.CSRC / "salient_write_kernel.cu"
    variant = tmp_path / "variant.cu"
    variant.write_text(served.read_text() + "\n// a variant\n")
    functions = build_variants([served, variant], tmp_path, "90")
    assert list(functions) == ["salient_write_kernel.cu", "variant.cu"]
    assert functions["salient_write_kernel.cu"] is not functions["variant.cu"]
    for function in functions.values():  # an all-zero argument struct: no dtype the kernel covers
        assert function(ctypes.byref(cuda_salient_write._SalientWriteArgs())) == 1  # cudaErrorInvalidValue
