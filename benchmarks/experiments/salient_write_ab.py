"""Variants of ZipCache's CUDA decode write (``csrc/salient_write_kernel.cu``) timed in one process:
each variant source built with nvcc and the served build's flags (``cuda_jit.build_library``), loaded
in place of the served library, and timed on the same pages (``kernels.py --zipcache``'s write cases:
widening, a held token, the block's slots full, both, blocks filled as in serving; and, for MHA, the
decode step: the CUDA decode, then the write), 144 and 8 decode rows of the Llama-2-7B and Llama-3-8B
shapes, in turn and in reverse turn (the lower of the two kept). Each variant's pages after one write
of each case are compared with the first variant's. End-to-end runs move with the machine by more
than a small kernel change; one process keeps a comparison on one card.

    git show REV:csrc/salient_write_kernel.cu > /tmp/before.cu
    python -m benchmarks.experiments.salient_write_ab /tmp/before.cu csrc/salient_write_kernel.cu
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch


def build_variants(sources: list[Path], out_dir: Path, arch: str) -> dict[str, ctypes._CFuncPtr]:
    """Each source's launch function (``kvc_salient_write``), by the source's file name."""
    from vllm_kvcompress import cuda_jit, cuda_salient_write

    functions = {}
    for i, source in enumerate(sources):
        library = cuda_jit.build_library(source, out_dir / f"variant{i}.so", (arch,))
        function = ctypes.CDLL(str(library)).kvc_salient_write
        function.argtypes = [ctypes.POINTER(cuda_salient_write._SalientWriteArgs)]
        function.restype = ctypes.c_int
        functions[source.name if source.name not in functions else f"{source.name}#{i}"] = function
    return functions


def time_variants(functions: dict, hq: int, hkv: int, rows: int) -> tuple[dict[tuple[str, str], float], bool]:
    """(us by (variant, case), whether every variant leaves the pages the first one does)."""
    from benchmarks.kernels import _time_on_pages_ms, salient_write_cases, serving_lens
    from vllm_kvcompress import cuda_salient_decode, cuda_salient_write
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.formats.salient import SalientTokensFormat
    from vllm_kvcompress.triton_kernels.decode import longest_first

    d = 128
    fmt = SalientTokensFormat.create(0.6, torch.bfloat16, 128, hkv, d)
    spec, scale = SalientSpec(ratio=0.6), d ** -0.5
    lens = serving_lens(rows, 900)
    write_cases = salient_write_cases(fmt, lens)
    cache, table, _ = write_cases["widening"]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.zeros(rows, hq, device="cuda")
    history = seq_lens - 1
    order, out = longest_first(history), torch.empty_like(q)

    def write(pages, block_table, new_k):
        return lambda: cuda_salient_write.write_decoded(q, new_k, v, pages, fmt, spec, block_table, seq_lens, lse,
                                                        scale)

    def step(pages, block_table, new_k):
        def run():
            step_lse = cuda_salient_decode.decode_rows(q, new_k, v, pages, fmt, block_table, history, scale, max(lens),
                                                       out, row_order=order)
            cuda_salient_write.write_decoded(q, new_k, v, pages, fmt, spec, block_table, seq_lens, step_lse.t(), scale)
        return run

    cases = {case: (pages, write(pages, case_table, k_scale * k))
             for case, (pages, case_table, k_scale) in write_cases.items()}
    if hq == hkv:  # where the CUDA decode serves
        filling, filling_table, _ = write_cases["blocks filled as in serving"]
        cases |= {"step, widening": (cache, step(cache, table, k)), "step, held": (cache, step(cache, table, 0.1 * k)),
                  "step, serving's blocks": (filling, step(filling, filling_table, k))}
    names = list(functions)
    times: dict[tuple[str, str], float] = {}
    for turn in (names, names[::-1]):
        for name in turn:
            cuda_salient_write._kernel.__dict__["_function"] = functions[name]  # the cached launch function
            for case, (pages, fn) in cases.items():
                us = _time_on_pages_ms(pages, fn) * 1e3
                times[name, case] = min(us, times.get((name, case), us))
    after = []
    for name in names:
        cuda_salient_write._kernel.__dict__["_function"] = functions[name]
        written = []
        for pages, case_table, k_scale in write_cases.values():
            written.append(pages.clone())
            write(written[-1], case_table, k_scale * k)()
        after.append(torch.cat(written))
    cuda_salient_write._kernel.__dict__.pop("_function")
    return times, all(torch.equal(after[0], x) for x in after[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", type=Path, help="variants of csrc/salient_write_kernel.cu")
    args = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    with tempfile.TemporaryDirectory() as tmp:
        functions = build_variants(args.sources, Path(tmp), f"{major}{minor}")
        for label, hq, hkv in (("MHA 32/32", 32, 32), ("GQA 32/8", 32, 8)):
            for rows in (144, 8):
                times, same = time_variants(functions, hq, hkv, rows)
                for name in functions:
                    cells = "  ".join(f"{case} {us:6.1f}" for (n, case), us in times.items() if n == name)
                    print(f"{label}, {rows:3d} rows, {name:24s} {cells}  (us)")
                print(f"{label}, {rows:3d} rows: pages {'alike' if same else 'DIFFER'} after every variant's write")


if __name__ == "__main__":
    main()
