"""Where ZipCache's prompt write spends its time: the Triton write of prompt chunks
(``salient_write.write_chunks``) timed on a ShareGPT-like step (fresh prompts, no history) and on
chunks after a history, with the probes' scores computed in it (serving's) and drawn (the write
without its scoring), at a few tiles, warps and probes a product, beside quant-k4v4's write of the
same tokens (the CUDA kernels needed: nvcc or prebuilt).

    python -m benchmarks.experiments.zipcache_prompt_write [--tunings 16,4 32,4,32]
"""

from __future__ import annotations

import argparse

import torch


def cases():
    """(label, chunk lengths, history each). ShareGPT's steps with prompts carry few of them: 1 to 13
    blocks a step, a median of 778 prompt tokens (H200 profile and step log, 2026-12-01), where the
    launch's time is one program's chain, not throughput."""
    return [("32 fresh prompts of 256", [256] * 32, 0), ("16 fresh prompts of 200", [200] * 16, 0),
            ("3 fresh prompts of 260", [260] * 3, 0), ("1 fresh prompt of 800", [800], 0),
            ("8 chunks of 512 after 1536", [512] * 8, 1536)]


def main() -> None:
    from benchmarks.kernels import SHAPES, _time_on_pages_ms, bench_write_mixed, salient_pages
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.formats.salient import SalientTokensFormat
    from vllm_kvcompress.salient_torch import plan_chunk_writes
    from vllm_kvcompress.triton_kernels.salient_write import write_chunks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tunings", nargs="*", default=[], metavar="TILE,WARPS[,PROBES]")
    args = ap.parse_args()
    tunings = [{}] + [dict(zip(("tile", "num_warps", "probes"), map(int, t.split(",")))) for t in args.tunings]
    for name, hq, hkv, d in SHAPES:
        fmt = SalientTokensFormat.create(0.6, torch.bfloat16, 128, hkv, d)
        for label, lengths, history in cases():
            n = len(lengths)
            cache, table = salient_pages(fmt, n, history + max(lengths))
            starts = [0]
            for m in lengths:
                starts.append(starts[-1] + m)
            total = starts[-1]
            q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            lse = torch.full((total, hq), 3.0, device="cuda")
            contexts = [history + m for m in lengths]
            for score in ("normalized", "random"):
                spec = SalientSpec(ratio=0.6, score=score)
                writes = plan_chunk_writes(fmt, spec, starts, contexts, table)
                for tuning in tunings:
                    ms = _time_on_pages_ms(cache, lambda: write_chunks(q, k, v, cache, fmt, spec, writes, lse,
                                                                       d ** -0.5, **tuning))
                    print(f"{name:24s} {label:28s} scores {score:10s} {str(tuning or 'default'):32s} "
                          f"{ms * 1e3:8.1f} us")
            if history == 0:  # the same prompts into 4-bit pages (and one decode row)
                for cuda in (False, True):
                    r = bench_write_mixed(4, 1, n, lengths[0], hkv, d, cuda=cuda)
                    print(f"{name:24s} {label:28s} quant-k4v4 write {'CUDA' if cuda else 'Triton':10s} "
                          f"{r['ms'] * 1e3:8.1f} us")


if __name__ == "__main__":
    main()
