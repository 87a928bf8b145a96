"""Registers and spills of the kernels a serving step launches, compiled for sm_90 on any machine.

A program's registers decide how many programs a SM holds, and a latency-bound kernel (a write)
runs at that occupancy. The count depends on the Triton version: with the one the GPU machine
runs (torch's; 3.6.0 under vLLM 0.32) it is the count the GPU reports as ``n_regs`` (H200,
2026-11-29: ZipCache's decode write uncapped 221 / 222 both ways); the CPU suite's newer Triton
gives other counts. Put that version beside the installed one:

    python -m pip install --no-deps --target DIR triton==3.6.0
    PYTHONPATH=DIR python -m benchmarks.registers

Each kernel is compiled with its variant's constants and options (``num_warps``, ``num_stages``,
``maxnreg``) and specialized as serving's arguments are: pointers 16-byte aligned, row strides
multiples of 16. Shapes: Llama-2-7B (MHA) and Llama-3-8B (GQA), pages of 128 tokens.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.kernels import SHAPES, _format
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.triton_kernels import decode, salient_write

_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def registers(variant, runtime: dict[str, str], aligned: set[str]) -> str:
    """``variant`` compiled for sm_90: its ``REG`` and ``STACK`` (spilled bytes) as cuobjdump prints
    them. ``runtime``: the types of the arguments that are not constants; ``aligned``: those
    specialized as multiples of 16."""
    kernel = variant.kernel
    names = kernel.arg_names
    compiled = triton.compile(
        ASTSource(fn=kernel, signature={name: runtime.get(name, "constexpr") for name in names},
                  constexprs={(names.index(name),): value for name, value in variant.constants.items()},
                  attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned}),
        target=GPUTarget("cuda", 90, 32), options=variant.options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_CUOBJDUMP, "-res-usage", cubin.name], capture_output=True, text=True).stdout
    return " ".join(field for line in usage.splitlines() if "REG:" in line
                    for field in line.split() if field.startswith(("REG:", "STACK:")))


def _write_kernels(hq: int, hkv: int, d: int):
    """ZipCache's write: a decode row's and a prompt chunk's (normalized probe scores), into blocks with
    stored tokens and into fresh ones."""
    fmt = SalientTokensFormat.create(0.6, torch.bfloat16, 128, hkv, d)
    names = salient_write._salient_write_kernel.arg_names
    runtime = {name: "*i32" for name in names if name.endswith("_ptr")}
    runtime |= dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", lse_ptr="*fp32", scores_ptr="*fp32",
                    pages_ptr="*u8", scale="fp32", interval="i32", window="i32", first_block="i32")
    runtime |= {name: "i32" for name in names if name.endswith("_stride")}
    aligned = {name for name in runtime if name.endswith("_ptr")} | {
        "q_row_stride", "q_head_stride", "k_row_stride", "v_row_stride"}
    for label, decode_rows, fresh in (("decode rows", True, False), ("prompt chunks", False, False),
                                      ("prompt chunks, fresh blocks", False, True)):
        tile, warps = salient_write.default_tuning(hq // hkv, decode_rows, fresh)
        variant = salient_write._variant(fmt, hq // hkv, tile, warps, decode_rows, False, not decode_rows, fresh)
        yield f"zipcache-r60 write, {label}", variant, runtime, aligned


def _decode_kernels(hq: int, hkv: int, d: int):
    """The layer decode kernel over ZipCache's and the 4-bit preset's pages: a decode row (rows
    longest first, continuing the row's own token; ZipCache's with its log-sum-exp out)."""
    names = decode._decode_kernel.arg_names
    runtime = dict(q_ptr="*bf16", cache_ptr="*u8", half_ptr="*fp16", block_table_ptr="*i32", seq_lens_ptr="*i32",
                   group_rows_ptr="*i32", group_start_ptr="*i32", first_ptr="*i32", out_ptr="*bf16",
                   part_ptr="*fp32", lse_ptr="*fp32", sm_scale="fp32")
    runtime |= {name: "i32" for name in names if name not in runtime and name.islower()}
    for label, fmt, lse_out in (("zipcache-r60", SalientTokensFormat.create(0.6, torch.bfloat16, 128, hkv, d), True),
                                ("quant-k4v4", _format(4, hkv, d, 128), False)):
        aligned = {name for name in runtime if name.endswith("_ptr")} | {"q_stride", "out_stride"}
        aligned |= {"page_bytes", "page_halves"} if fmt.page_bytes % 32 == 0 else set()
        variant = decode._variant(fmt, hq // hkv, False, None, True, None, None, None, True, True, False, lse_out)
        yield f"{label} decode kernel, decode rows", variant, runtime, aligned


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90")
    for name, hq, hkv, d in SHAPES:
        for label, variant, runtime, aligned in (*_decode_kernels(hq, hkv, d), *_write_kernels(hq, hkv, d)):
            options = ", ".join(f"{key} {value}" for key, value in variant.options.items())
            print(f"{name:24s} {label:42s} {options:36s} {registers(variant, runtime, aligned)}", flush=True)


if __name__ == "__main__":
    main()
