"""Decode- and write-kernel microbenchmarks on the GPU.

Times our Triton decode over packed pages against vLLM's FlashAttention bf16
decode on the same shape, and the device's copy bandwidth measured in the same
run. Bandwidth figures count bytes moved (a copy: read + written; decode: the
compressed pages and queries read; write: each touched page read and written, an upper bound
now that a token which fits its grids writes one row).

    python benchmarks/kernels.py --out results/kernels.json [--sweep] [--scaling] [--write-chunks 8 32]
    python benchmarks/kernels.py --host   # host time of a mixed step's attention calls, a layer
    python benchmarks/kernels.py --prompts   # prompt chunks after history: FlashAttention bf16 against ours (both routes)
    python benchmarks/kernels.py --zipcache  # ZipCache's attention of a layer in parts, beside the 4-bit preset's
    python benchmarks/kernels.py --split-rows  # ZipCache's decode over split-row pages, beside the slot map's
    python benchmarks/kernels.py --minicache  # MiniCache's merged pair in parts, beside two 4-bit layers
    python benchmarks/kernels.py --presets quant-k3v2-o1 quant-k4v4  # presets' decode rows and write
    python benchmarks/kernels.py --slim      # slim attention's decode rows in parts, against FlashAttention bf16
    ncu ... python benchmarks/kernels.py --profile 4 32 32     # one decode launch per repeat, for a profiler
    ncu ... python benchmarks/kernels.py --profile-write 4 32  # the decode step's cache write only
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

SHAPES = [("Llama-2-7B (MHA 32/32)", 32, 32, 128), ("Llama-3-8B (GQA 32/8)", 32, 8, 128)]


def _time_ms(fn, reps: int = 50) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")


def _time_on_pages_ms(pages: torch.Tensor, fn, reps: int = 100) -> float:
    """Median time of ``fn`` alone (CUDA events around it), ``pages`` restored before each call: a
    write changes them, and each must meet the same state. Timing the restore and the write
    together and subtracting the restore's own time left a difference that moved by 2x between
    runs. The GPU waits (``torch.cuda._sleep``) while the host launches ``fn``, so the events time
    the kernels, not the host's launch latency. ``pages`` are left as they came: a later row timed on
    them after a write would meet that write's state (its grids already widened for the same K)."""
    saved = pages.clone()
    for _ in range(10):
        pages.copy_(saved), fn()
    times = []
    for _ in range(reps):
        pages.copy_(saved)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # about 1 ms: the host has launched fn before the start event
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    pages.copy_(saved)
    return statistics.median(a.elapsed_time(b) for a, b in times)


def _host_ms(fn, pages: torch.Tensor | None = None, reps: int = 50) -> float:
    """The host's time to launch ``fn`` (mean of ``reps`` calls, the GPU not waited for): where it
    exceeds the GPU's, a layer outside CUDA graphs leaves the GPU idle. ``pages``, which ``fn``
    writes, are left as they came."""
    saved = None if pages is None else pages.clone()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    ms = (time.perf_counter() - start) / reps * 1e3
    torch.cuda.synchronize()
    if saved is not None:
        pages.copy_(saved)
    return ms


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def _format(bits: int | str, hkv: int, d: int, block: int):
    """K and V at ``bits``, or a preset's default layer format where ``bits`` names one."""
    from vllm_kvcompress.config import LayerFormat, load_config
    from vllm_kvcompress.formats import KVPageFormat
    layer = load_config(bits).default if isinstance(bits, str) else LayerFormat(k_bits=bits, v_bits=bits)
    return KVPageFormat.from_layer_format(layer, torch.bfloat16, block, hkv, d)


def _name(bits: int | str) -> str:
    return bits if isinstance(bits, str) else f"k{bits}v{bits}"


def _pages(fmt, num_seqs: int, ctx: int, seed: int = 0, encode=None):
    """Random (never zero) full pages, encoded a few at a time through the reference (``encode(k, v,
    num_valid)``, by default the format's) and tiled, behind a shuffled block table."""
    B, H, D = fmt.block_size, fmt.k.num_heads, fmt.k.head_size
    blocks_per_seq = math.ceil(ctx / B)
    n_blocks = num_seqs * blocks_per_seq
    cache = torch.empty(n_blocks, fmt.page_bytes, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    chunk = 256
    k = torch.randn(chunk, B, H, D, device="cuda", generator=gen)
    v = torch.randn(chunk, B, H, D, device="cuda", generator=gen)
    proto = (encode or fmt.encode)(k, v, torch.full((chunk,), B, device="cuda"))
    for i in range(0, n_blocks, chunk):
        cache[i:i + chunk] = proto[: min(chunk, n_blocks - i)]
    table = torch.randperm(n_blocks, device="cuda", dtype=torch.int64).to(torch.int32).view(num_seqs, blocks_per_seq)
    return cache, table


def salient_pages(fmt, num_seqs: int, ctx: int, leading: bool = False):
    """``_pages`` of ZipCache's format, full blocks with as many salient tokens as slots: drawn at
    random (a decode row's block, read up to its context, has about 60% of its tokens salient and
    free slots), or its first tokens (``leading``: past them a new token must evict one)."""
    def salient(k):
        order = torch.arange(fmt.block_size, device=k.device)[None, :, None] if leading else \
            torch.rand(k.shape[:3], device=k.device).argsort(1)
        return (order < fmt.slots).expand(k.shape[:3])
    return _pages(fmt, num_seqs, ctx, encode=lambda k, v, n: fmt.encode(k, v, n, salient(k)))


def filling_salient_pages(fmt, lens: list[int]):
    """``salient_pages`` whose rows' last blocks hold only the tokens before each row's new one, K's
    grid over them alone, as appends leave a block in serving: a new token widens about 2 / (n + 1)
    of the channels of a block of n tokens, most of them in a block's first tokens."""
    cache, table = salient_pages(fmt, len(lens), max(lens))
    B, H, D = fmt.block_size, fmt.k.num_heads, fmt.k.head_size
    gen = torch.Generator(device="cuda").manual_seed(1)
    k, v = (torch.randn(len(lens), B, H, D, device="cuda", generator=gen) for _ in range(2))
    stored = torch.tensor([(L - 1) % B for L in lens], device="cuda")
    order = torch.rand(k.shape[:3], device="cuda", generator=gen).argsort(1)
    last = table[torch.arange(len(lens), device="cuda"), torch.tensor([(L - 1) // B for L in lens], device="cuda")]
    cache[last.long()] = fmt.encode(k, v, stored, order < fmt.slots)
    return cache, table


def salient_write_cases(fmt, lens: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """ZipCache's decode write over ``salient_pages`` for rows of context ``lens``, by case: (pages,
    block table, the new K's scale). A random new K widens some channel of most rows' blocks (their
    earlier tokens re-coded); a tenth of it widens none: a held token written alone, or, past the
    leading salient tokens, the block's tokens scored and one dropped. Last, serving's blocks
    (``filling_salient_pages``), where the rows in a block's first tokens widen most channels."""
    cache, table = salient_pages(fmt, len(lens), max(lens))
    full, full_table = salient_pages(fmt, len(lens), max(lens), leading=True)
    filling, filling_table = filling_salient_pages(fmt, lens)
    return {"widening": (cache, table, 1.0), "no widening (a held token)": (cache, table, 0.1),
            f"no widening, slots full past {fmt.slots} tokens": (full, full_table, 0.1),
            "slots full, widening": (full, full_table, 1.0),
            "blocks filled as in serving": (filling, filling_table, 1.0)}


def serving_lens(num_seqs: int, ctx: int, seed: int = 0) -> list[int]:
    """Context lengths of a serving step's decode rows: uniform in [16, ctx], seeded. With ctx 900
    and 144 rows (about 65,000 tokens) they fill an 8 GiB 4/4 cache of the Llama-2-7B shape as a
    ShareGPT run does (128 to 144 running requests, cache full)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(16, ctx + 1, (num_seqs,), generator=gen).tolist()


def _decode_case(bits: int, num_seqs: int, hq: int, hkv: int, d: int, ctx: int, block: int,
                 lens: list[int] | None = None):
    fmt = _format(bits, hkv, d, block)
    cache, table = _pages(fmt, num_seqs, ctx)
    q = torch.randn(num_seqs, hq, d, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens or [ctx] * num_seqs, dtype=torch.int32, device="cuda")
    pages = sum(math.ceil(n / block) for n in lens) if lens else num_seqs * table.shape[1]
    nbytes = pages * fmt.page_bytes + 2 * q.numel() * 2
    return fmt, cache, table, q, seq_lens, nbytes


def bench_ours(bits: int, num_seqs: int, hq: int, hkv: int, d: int, ctx: int, block: int = 128,
               lens: list[int] | None = None, as_drawn: bool = False, cuda: bool = False, **tuning) -> dict:
    """``lens``: each row's context length (at most ctx); all ctx without. Rows go to programs longest
    first, as the backend orders them, or with ``as_drawn`` in their own order. ``cuda``: the CUDA
    kernel (``vllm_kvcompress.cuda_decode``; 4/4 MHA) instead of the Triton one."""
    from vllm_kvcompress.triton_kernels.decode import longest_first
    if cuda:
        from vllm_kvcompress.cuda_decode import paged_decode
    else:
        from vllm_kvcompress.triton_kernels.decode import paged_decode

    fmt, cache, table, q, seq_lens, nbytes = _decode_case(bits, num_seqs, hq, hkv, d, ctx, block, lens)
    out = torch.empty_like(q)
    order = None if as_drawn else longest_first(seq_lens)
    ms = _time_ms(lambda: paged_decode(q, cache, fmt, table, seq_lens, d ** -0.5, ctx, out=out, row_order=order,
                                       **tuning))
    name = f"ours {_name(bits)}" + " CUDA" * cuda + " as drawn" * as_drawn + "".join(f" {k}={v}" for k, v in tuning.items())
    return {"kernel": name, "block": block, "ms": ms, "bytes": nbytes, "GB/s": nbytes / ms / 1e6}


def bench_flash_bf16(num_seqs: int, hq: int, hkv: int, d: int, ctx: int, block: int = 16,
                     lens: list[int] | None = None) -> dict:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    blocks_per_seq = math.ceil(ctx / block)
    n_blocks = num_seqs * blocks_per_seq
    k = torch.randn(n_blocks, block, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(n_blocks, device="cuda").to(torch.int32).view(num_seqs, blocks_per_seq)
    q = torch.randn(num_seqs, hq, d, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    seqused = torch.tensor(lens or [ctx] * num_seqs, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def run():
        flash_attn_varlen_func(q, k, v, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=ctx, seqused_k=seqused,
                               softmax_scale=d ** -0.5, causal=True, block_table=table, out=out, fa_version=3)
    ms = _time_ms(run)
    nbytes = 2 * sum(lens or [ctx] * num_seqs) * hkv * d * 2 + 2 * q.numel() * 2
    return {"kernel": "vLLM FlashAttention bf16", "block": block, "ms": ms, "bytes": nbytes, "GB/s": nbytes / ms / 1e6}


def bench_prompt_chunks(bits: int, num_prompts: int, hq: int, hkv: int, d: int, prompt: int, history: int,
                        block: int = 128, prompt_rows: int | None = None, route: str = "serving", **tuning) -> dict:
    """``num_prompts`` prefill chunks of ``prompt`` tokens, each after ``history`` tokens in its pages,
    as the backend runs them: ``route`` "serving" (``history.prompt_chunks``, the plain min-max
    pages' route, which picks one of the two below), "history" (``history.dense_prompt``): the
    history decoded once into 16-bit rows, then FlashAttention over it and the chunk;
    "decode-kernel" (``triton_kernels.prompt``, pages with outlier tokens and MiniCache's):
    FlashAttention over the chunk's own K/V, then the decode kernel's rows over the history,
    continuing from FlashAttention's state. ``prompt_rows`` (a program's rows) and ``tuning``
    (``tile``, ``num_warps``, ``num_stages``): the decode kernel's, where not its defaults."""
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels.decode import PROMPT_ROWS, rows_per_program
    from vllm_kvcompress.triton_kernels.history import dense_prompt, prompt_chunks
    from vllm_kvcompress.triton_kernels.prompt import paged_prompt

    fmt, cache, table, _, _, _ = _decode_case(bits, num_prompts, hq, hkv, d, history + prompt, block)
    n = num_prompts * prompt
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows = token_rows(list(range(0, n + 1, prompt)), [history] * num_prompts, table,
                      rows_per_program(hq // hkv, prompt_rows or PROMPT_ROWS))
    out = torch.empty_like(q)
    if route in ("serving", "history"):
        run = prompt_chunks if route == "serving" else dense_prompt
        ms = _time_ms(lambda: run(q, k, v, cache, fmt, rows, d ** -0.5, out))
    else:
        ms = _time_ms(lambda: paged_prompt(q, k, v, cache, fmt, rows, d ** -0.5, out, **tuning))
    nbytes = num_prompts * -(-history // block) * fmt.page_bytes + (2 * q.numel() + 2 * k.numel()) * 2
    return {"kernel": f"ours k{bits}v{bits} prompt chunks, {route}", "block": block, "ms": ms, "bytes": nbytes,
            "GB/s": nbytes / ms / 1e6}


def bench_flash_prefill_bf16(num_prompts: int, hq: int, hkv: int, d: int, prompt: int, history: int,
                             block: int = 16) -> dict:
    """vLLM's FlashAttention on the same prefill chunks, bf16 pages holding history and chunk."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    context = history + prompt
    blocks_per_seq = math.ceil(context / block)
    k = torch.randn(num_prompts * blocks_per_seq, block, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.arange(num_prompts * blocks_per_seq, device="cuda", dtype=torch.int32).view(num_prompts, -1)
    n = num_prompts * prompt
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(0, n + 1, prompt, dtype=torch.int32, device="cuda")
    seqused = torch.full((num_prompts,), context, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def run():
        flash_attn_varlen_func(q, k, v, max_seqlen_q=prompt, cu_seqlens_q=cu_q, max_seqlen_k=context, seqused_k=seqused,
                               softmax_scale=d ** -0.5, causal=True, block_table=table, out=out, fa_version=3)
    ms = _time_ms(run)
    nbytes = 2 * num_prompts * context * hkv * d * 2 + 2 * q.numel() * 2
    return {"kernel": "vLLM FlashAttention bf16 prefill", "block": block, "ms": ms, "bytes": nbytes,
            "GB/s": nbytes / ms / 1e6}


def _appending_pages(write_tokens, fmt, num_seqs: int, spare: int, gen: torch.Generator, room: int = 1):
    """Pages of ``num_seqs`` requests whose last page holds 1 to block-room earlier tokens (spread
    evenly over the batch, as in a serving batch), written with ``write_tokens``, then ``spare``
    empty pages; and each request's next slot."""
    block, hkv, d = fmt.block_size, fmt.k.num_heads, fmt.k.head_size
    fills = [1 + s * (block - 1 - room) // max(1, num_seqs - 1) for s in range(num_seqs)]
    cache = torch.zeros(num_seqs + spare, fmt.page_bytes, dtype=torch.uint8, device="cuda")
    earlier = torch.cat([s * block + torch.arange(n, device="cuda") for s, n in enumerate(fills)])
    k0, v0 = (torch.randn(len(earlier), hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    write_tokens(cache, fmt, k0, v0, earlier)
    return cache, torch.tensor([s * block + n for s, n in enumerate(fills)], device="cuda")


def _write_kernel(cuda: bool):
    """The cache write of the CUDA kernel (csrc/) or of the Triton one."""
    if cuda:
        from vllm_kvcompress.cuda_write import write_tokens
    else:
        from vllm_kvcompress.triton_kernels.write import write_tokens
    return write_tokens


def bench_write(bits: int, num_seqs: int, hkv: int, d: int, block: int = 128, chunk_channels: int | None = None,
                spread: int | None = None, num_warps: int | None = None, cuda: bool = False,
                dealt: bool | None = None, steps: int = 1) -> dict:
    """Decode steps' cache writes, us a step: each request appends a token to its last page
    (``_appending_pages``, with room for ``steps`` tokens), from the same distribution. The pages
    are restored before every run of ``steps`` writes and only the writes are timed, so every run
    meets the same page state: a token that fits its channels' grids writes one row, one that widens
    a channel re-encodes that chunk of channels (the restored pages may sit in L2). With ``steps``
    > 1 a channel's grid meets the tokens after the one that widened it, as in serving.
    ``cuda``: the CUDA kernel (csrc/) instead of the Triton one; ``dealt``: force the Triton write's
    mode (None: its own choice by the step's size)."""
    write_tokens = _write_kernel(cuda)
    fmt = _format(bits, hkv, d, block)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache, slots = _appending_pages(write_tokens, fmt, num_seqs, 0, gen, room=steps)
    k, v = (torch.randn(steps, num_seqs, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    step_slots = [slots + step for step in range(steps)]
    tuning = {key: val for key, val in (("chunk_channels", chunk_channels), ("spread", spread), ("num_warps", num_warps))
              if val} | ({} if dealt is None else {"dealt": dealt})

    def run():
        for step in range(steps):
            write_tokens(cache, fmt, k[step], v[step], step_slots[step], **tuning)

    ms = _time_on_pages_ms(cache, run, reps=max(20, 100 // steps)) / steps
    nbytes = 2 * num_seqs * fmt.page_bytes
    label = (f"write {_name(bits)}" + (f" {steps} steps in a row" if steps > 1 else "") + (" CUDA" if cuda else "")
             + (f" chunk {chunk_channels}" if chunk_channels else "") + (f" spread {spread}" if spread else "")
             + (f" warps {num_warps}" if num_warps else "") + ("" if dealt is None else f" dealt={dealt}"))
    return {"kernel": label, "block": block, "ms": ms, "bytes": nbytes, "GB/s": nbytes / ms / 1e6}


def bench_write_mixed(bits: int, num_seqs: int, prompts: int, prompt_len: int, hkv: int, d: int,
                      block: int = 128, cuda: bool = False) -> dict:
    """A mixed step's cache write: ``num_seqs`` decodes appending to their last pages
    (``_appending_pages``), then ``prompts`` prompts of ``prompt_len`` tokens into empty pages;
    pages restored before every write. ``cuda`` as for ``bench_write``."""
    write_tokens = _write_kernel(cuda)

    fmt = _format(bits, hkv, d, block)
    pages = -(-prompt_len // block)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache, decodes = _appending_pages(write_tokens, fmt, num_seqs, prompts * pages, gen)
    slots = torch.cat([decodes]
                      + [(num_seqs + p * pages) * block + torch.arange(prompt_len, device="cuda")
                         for p in range(prompts)])
    k, v = (torch.randn(len(slots), hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    ms = _time_on_pages_ms(cache, lambda: write_tokens(cache, fmt, k, v, slots))
    nbytes = 2 * len(cache) * fmt.page_bytes + 2 * k.numel() * k.element_size()
    label = f"write k{bits}v{bits} {num_seqs} decodes + {prompts}x{prompt_len}" + (" CUDA" if cuda else "")
    return {"kernel": label, "block": block, "ms": ms, "bytes": nbytes, "GB/s": nbytes / ms / 1e6}


def bench_write_prefill(bits: int, num_blocks: int, hkv: int, d: int, block: int = 128,
                        dealt: bool | None = None, cuda: bool = False) -> dict:
    """A prefill chunk's cache write: ``num_blocks`` whole blocks of new tokens (one long prompt's
    chunk), each block encoded by its last tokens' programs. ``dealt`` and ``cuda`` as for ``bench_write``."""
    write_tokens = _write_kernel(cuda)

    fmt = _format(bits, hkv, d, block)
    n = num_blocks * block
    cache = torch.zeros(num_blocks, fmt.page_bytes, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(n, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.arange(n, device="cuda")
    ms = _time_ms(lambda: write_tokens(cache, fmt, k, v, slots, **({} if dealt is None else {"dealt": dealt})))
    nbytes = num_blocks * fmt.page_bytes + 2 * k.numel() * k.element_size()
    label = (f"write k{bits}v{bits} prefill {n} tokens" + ("" if dealt is None else f" dealt={dealt}")
             + (" CUDA" if cuda else ""))
    return {"kernel": label, "block": block, "ms": ms, "bytes": nbytes,
            "GB/s": nbytes / ms / 1e6}


STEP_PARTS = ("copies", "write", "decode")


def bench_step_layers(bits: int, lens: list[int], hq: int, hkv: int, d: int = 128, layers: int = 32,
                      block: int = 128, max_model_len: int = 2048, replays: int = 20,
                      parts: tuple[str, ...] = STEP_PARTS, num_splits: int | None = None) -> dict:
    """A decode step's attention as vLLM's full CUDA graph replays it, us a layer: for each of
    ``layers`` layers (each with its own pages, so they do not sit in L2), a copy that stands in for
    the kernel making the step's query, K and V, the CUDA cache write of each row's next token, the
    CUDA decode (split for any context up to ``max_model_len``, as captured) and a copy of its output
    that stands in for the output projection. Unlike timing each kernel alone, the gaps between
    kernels count, as they do in serving. ``parts``: which of ``STEP_PARTS`` the graph holds;
    ``num_splits``: the decode's split count (None: ``cuda_decode.choose_num_splits``'s, as the backend's);
    the result's ``splits`` is the count it ran.

    The pages are full (``_pages``) and every replay writes the same tokens to the same slots, so no
    channel widens after the first replay (``bench_write`` restores its pages for that); one of the
    serving step's rows starts a block, as about two serving steps of three with 144 rows have one."""
    from vllm_kvcompress.cuda_decode import choose_num_splits, paged_decode
    from vllm_kvcompress.cuda_write import write_tokens
    from vllm_kvcompress.triton_kernels.decode import longest_first

    n = len(lens)
    splits = num_splits or choose_num_splits(n, hkv, max_model_len, torch.device("cuda"))
    fmt, cache, table, _, _, nbytes = _decode_case(bits, n, hq, hkv, d, max(lens) + 1, block, lens)
    caches = [cache] + [cache.clone() for _ in range(layers - 1)]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda") + 1  # the new token included
    positions = seq_lens.long() - 1
    slots = table.gather(1, (positions // block)[:, None])[:, 0].long() * block + positions % block
    order = longest_first(seq_lens)
    gen = torch.Generator(device="cuda").manual_seed(1)
    made = torch.randn(n, (hq + 2 * hkv) * d, device="cuda", generator=gen, dtype=torch.bfloat16)
    qkv = torch.empty_like(made)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    out = torch.empty(n, hq, d, device="cuda", dtype=torch.bfloat16)
    after = torch.empty_like(out)

    def step():
        for pages in caches:
            if "copies" in parts:
                qkv.copy_(made)
            if "write" in parts:
                write_tokens(pages, fmt, k, v, slots)
            if "decode" in parts:
                paged_decode(q, pages, fmt, table, seq_lens, d ** -0.5, max_model_len, num_splits=splits, out=out,
                             row_order=order)
            if "copies" in parts:
                after.copy_(out)

    step()  # builds and warms up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times) / layers
    return {"kernel": f"step k{bits}v{bits} {' + '.join(parts)}, {n} rows, {splits} splits, CUDA graph",
            "block": block, "splits": splits, "ms": ms, "bytes": nbytes, "GB/s": nbytes / ms / 1e6}


def bench_zipcache_step(lens: list[int], hq: int, hkv: int, d: int, block: int = 128,
                        prompt: tuple[int, int, int] = (8, 512, 1536)) -> list[dict]:
    """A layer's attention for ZipCache's pages (``zipcache-r60``) in parts, against the 4-bit preset's
    on the same rows: decode rows of context ``lens`` (the decode kernel over the pages alone; with
    the new token's own term and the write, whose probe scores and re-compression are the rest), and ``prompt`` = (chunks, tokens, history) prefill
    chunks (attention, then the batched write)."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.formats.salient import SalientTokensFormat
    from vllm_kvcompress.kernels import registry
    from vllm_kvcompress.policy import KernelPolicy
    from vllm_kvcompress.salient_torch import plan_chunk_writes
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels.decode import longest_first, paged_decode, rows_per_program
    from vllm_kvcompress.triton_kernels.salient_decode import decode_rows
    from vllm_kvcompress.triton_kernels.salient_prompt import salient_prompt
    from vllm_kvcompress.triton_kernels import salient_write
    from vllm_kvcompress.triton_kernels.salient_write import write_chunks

    fmt = SalientTokensFormat.create(0.6, torch.bfloat16, block, hkv, d)
    # the decode rows' kernels and write serving takes (kernels.registry's plan) first, then Triton's
    decodes = {"Triton": decode_rows}
    writes = {"Triton": salient_write.write_decoded}
    context = registry.LayerContext(registry.Device.of("cuda", torch.cuda.get_device_capability()), torch.bfloat16, hq)
    plan = registry.plan(fmt, context, KernelPolicy())
    if plan.decode.name == "cuda-salient":
        from vllm_kvcompress import cuda_salient_decode
        decodes = {"CUDA": cuda_salient_decode.decode_rows, **decodes}
    if plan.write.name == "cuda-salient":
        from vllm_kvcompress import cuda_salient_write
        writes = {"CUDA": cuda_salient_write.write_decoded, **writes}
    decode_served, write_decoded = next(iter(decodes.values())), next(iter(writes.values()))
    spec, scale = SalientSpec(ratio=0.6), d ** -0.5

    rows = []
    n = len(lens)
    write_cases = salient_write_cases(fmt, lens)
    cache, table, _ = write_cases["widening"]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    label = f"{n} decode rows"
    history = seq_lens - 1
    order = longest_first(history)
    prior = torch.zeros(hq, n, device="cuda")
    rows.append({"kernel": f"zipcache-r60 {label}: Triton decode kernel",
                 "ms": _time_ms(lambda: paged_decode(q, cache, fmt, table, history, scale, max(lens), out=out,
                                                     row_order=order, prior_lse=prior, lse_out=True))})

    def decode_step():
        lse = decode_served(q, k, v, cache, fmt, table, history, scale, max(lens), out, row_order=order)
        write_decoded(q, k, v, cache, fmt, spec, table, seq_lens, lse.t(), scale)

    for name, decode in decodes.items():
        rows.append({"kernel": f"zipcache-r60 {label}: own token + {name} kernel (no write)",
                     "ms": _time_ms(lambda: decode(q, k, v, cache, fmt, table, history, scale, max(lens), out,
                                                   row_order=order))})
    rows.append({"kernel": f"zipcache-r60 {label}: own token + {next(iter(decodes))} kernel + {next(iter(writes))} "
                           "write (probe scores, re-compression)", "ms": _time_on_pages_ms(cache, decode_step)})
    rows.append({"kernel": f"zipcache-r60 {label}: the same launched by the host (its time, not the GPU's)",
                 "ms": _host_ms(decode_step, cache)})
    lse = torch.zeros(n, hq, device="cuda")

    for name, write in writes.items():
        for case, (pages, case_table, k_scale) in write_cases.items():
            new_k = k_scale * k
            rows.append({"kernel": f"zipcache-r60 {label}: the {name} write alone, {case}",
                         "ms": _time_on_pages_ms(pages, lambda: write(q, new_k, v, pages, fmt, spec, case_table,
                                                                      seq_lens, lse, scale))})
    rows.append({"kernel": f"quant-k4v4 {label}: Triton decode",
                 "ms": bench_ours(4, n, hq, hkv, d, max(lens), block, lens=lens)["ms"]})
    if "CUDA" in decodes:
        rows.append({"kernel": f"quant-k4v4 {label}: CUDA decode",
                     "ms": bench_ours(4, n, hq, hkv, d, max(lens), block, lens=lens, cuda=True)["ms"]})
    rows.append({"kernel": f"quant-k4v4 {label}: Triton write", "ms": bench_write(4, n, hkv, d, block)["ms"]})
    if "CUDA" in writes:
        rows.append({"kernel": f"quant-k4v4 {label}: CUDA write",
                     "ms": bench_write(4, n, hkv, d, block, cuda=True)["ms"]})

    chunks, length, history = prompt
    label = f"{chunks}x{length} prompt tokens after {history}"
    cache, table = salient_pages(fmt, chunks, history + length)
    total = chunks * length
    qp = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
    kp, vp = (torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    outp = torch.empty_like(qp)
    starts, contexts = list(range(0, total + 1, length)), [history + length] * chunks
    token = token_rows(starts, [history] * chunks, table, rows_per_program(hq // hkv))
    writes = plan_chunk_writes(fmt, spec, starts, contexts, table)
    rows.append({"kernel": f"zipcache-r60 {label}: attention + write",
                 "ms": _time_ms(lambda: salient_prompt(qp, kp, vp, cache, fmt, spec, token, writes, scale, outp))})
    from vllm_kvcompress.triton_kernels import history as history_route
    paged = token_rows(starts, [history] * chunks, table, rows_per_program(hq // hkv))
    serving_rule = history_route.MIN_HEAD_ROWS_A_HISTORY_TOKEN
    history_route.MIN_HEAD_ROWS_A_HISTORY_TOKEN = 10 ** 9  # the decode kernel's route, for comparison
    try:  # the route is decided at a step's first call and kept on its rows
        salient_prompt(qp, kp, vp, cache, fmt, spec, paged, writes, scale, outp)
    finally:
        history_route.MIN_HEAD_ROWS_A_HISTORY_TOKEN = serving_rule
    rows.append({"kernel": f"zipcache-r60 {label}: attention + write, the decode kernel's route",
                 "ms": _time_ms(lambda: salient_prompt(qp, kp, vp, cache, fmt, spec, paged, writes, scale, outp))})
    lse_p = torch.zeros(total, hq, device="cuda")
    rows.append({"kernel": f"zipcache-r60 {label}: the write alone (probe scores in it)",
                 "ms": _time_on_pages_ms(cache, lambda: write_chunks(qp, kp, vp, cache, fmt, spec, writes, lse_p,
                                                                     scale))})
    rows.append({"kernel": f"zipcache-r60 {label}: the step's plan of the writes (once a step, host)",
                 "ms": _time_ms(lambda: plan_chunk_writes(fmt, spec, starts, contexts, table))})
    rows.append({"kernel": f"quant-k4v4 {label}: attention",
                 "ms": bench_prompt_chunks(4, chunks, hq, hkv, d, length, history, block)["ms"]})
    return rows


def bench_split_rows(lens: list[int], h: int = 32, d: int = 128, block: int = 128) -> list[dict]:
    """ZipCache's MHA decode rows (own token and log-sum-exp included) over split-row pages
    (``formats.salient_rows``, r = 0.5), beside the slot-map pages of the same tokens and quant-k4v4's
    CUDA decode of rows of the same contexts: the decode cost the split rows are for."""
    from vllm_kvcompress import cuda_salient_decode, cuda_salient_rows_decode
    from vllm_kvcompress.formats.salient_rows import SalientRowsFormat
    from vllm_kvcompress.triton_kernels.decode import longest_first

    fmt = SalientRowsFormat.create(torch.bfloat16, block, h, d)
    slot_pages, table = salient_pages(fmt.slot_map, len(lens), max(lens))
    pages = fmt.from_slot_map(slot_pages, torch.full((slot_pages.shape[0],), block, device="cuda"))
    history = torch.tensor(lens, dtype=torch.int32, device="cuda") - 1
    order = longest_first(history)
    q, k, v = (torch.randn(len(lens), h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    rows = []
    for label, module, cache, page_format in (("split rows", cuda_salient_rows_decode, pages, fmt),
                                              ("slot map", cuda_salient_decode, slot_pages, fmt.slot_map)):
        rows.append({"kernel": f"zipcache-r50 {len(lens)} decode rows: own token + CUDA decode, {label}",
                     "ms": _time_ms(lambda: module.decode_rows(q, k, v, cache, page_format, table, history, d ** -0.5,
                                                               max(lens), out, row_order=order))})
    rows.append({"kernel": f"quant-k4v4 {len(lens)} decode rows: CUDA decode",
                 "ms": bench_ours(4, len(lens), h, h, d, max(lens), block, lens=lens, cuda=True)["ms"]})
    return rows


def bench_minicache_step(lens: list[int], hq: int, hkv: int, d: int, block: int = 128) -> list[dict]:
    """A merged pair's attention for MiniCache's pages (``minicache-k4v4``) in parts, against two layers
    of the 4-bit preset on the same decode rows of context ``lens``: each layer's decode (its own new
    token, then the layer decode kernel over the pair's pages) and the pair's one write (the merge, the
    directions' codes, norms and retention)."""
    from vllm_kvcompress.config import load_config
    from vllm_kvcompress.formats.merged import MergedPairFormat
    from vllm_kvcompress.triton_kernels.merged_decode import decode_rows
    from vllm_kvcompress.triton_kernels.merged_write import write_pair_tokens
    from vllm_kvcompress.triton_kernels.pair_merge import merge_pair

    cfg = load_config("minicache-k4v4")
    fmt = MergedPairFormat.from_layer_format(cfg.default, cfg.merge.t, cfg.merge.gamma, torch.bfloat16, block, hkv, d)
    cache, table = _pages(fmt, len(lens), max(lens), encode=lambda k, v, n: fmt.encode(
        k, v, 1.5 * k + 0.3 * torch.randn_like(k), 0.7 * v + 0.3 * torch.randn_like(v), n))
    n = len(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    rows = torch.arange(n, device="cuda")
    slots = table[rows, (seq_lens - 1) // block].long() * block + (seq_lens - 1) % block
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    new = [torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    out = torch.empty_like(q)
    label = f"{n} decode rows"
    history = seq_lens - 1
    decode_ms = _time_ms(lambda: decode_rows(q, *new[:2], cache, fmt, 1, table, history, d ** -0.5, max(lens), out))
    write_ms = _time_ms(lambda: write_pair_tokens(cache, fmt, *new, slots))
    merge_ms = _time_ms(lambda: merge_pair(fmt, *new))
    torch_merge_ms = _time_ms(lambda: fmt.merge(*new))
    four_decode = bench_ours(4, n, hq, hkv, d, max(lens), block, lens=lens)["ms"]
    four_write = bench_write(4, n, hkv, d, block)["ms"]
    return [{"kernel": f"minicache-k4v4 {label}: a layer's decode (own token + kernel)", "ms": decode_ms},
            {"kernel": f"minicache-k4v4 {label}: the pair's write", "ms": write_ms},
            {"kernel": f"minicache-k4v4 {label}: of which the merge (kernel)", "ms": merge_ms},
            {"kernel": f"minicache-k4v4 {label}: the reference's merge (torch)", "ms": torch_merge_ms},
            {"kernel": f"minicache-k4v4 {label}: the pair (2 decodes + 1 write)", "ms": 2 * decode_ms + write_ms},
            {"kernel": f"quant-k4v4 {label}: 2 layers (2 decodes + 2 writes)", "ms": 2 * (four_decode + four_write)}]


def bench_preset_step(preset: str, lens: list[int], hq: int, hkv: int, d: int, block: int = 128,
                      tunings: list[dict] = ()) -> list[dict]:
    """A preset's decode rows of context ``lens`` (Triton) and a decode step's cache write (Triton, and
    CUDA where it serves the format): for formats the 4-bit preset's figures compare with
    (``quant-k3v2-o1``'s outlier tokens, 3-bit codes)."""
    from vllm_kvcompress.kernels import registry
    from vllm_kvcompress.policy import KernelPolicy

    rows = [bench_ours(preset, len(lens), hq, hkv, d, max(lens), block, lens=lens),
            *[bench_ours(preset, len(lens), hq, hkv, d, max(lens), block, lens=lens, **t) for t in tunings],
            bench_write(preset, len(lens), hkv, d, block)]
    device = registry.Device.of("cuda", torch.cuda.get_device_capability())
    context = registry.LayerContext(device, torch.bfloat16, hq)
    if registry.plan(_format(preset, hkv, d, block), context, KernelPolicy()).write.name == "cuda":
        rows.append(bench_write(preset, len(lens), hkv, d, block, cuda=True))
    return rows


def _host_us(fn, calls: int = 40, reps: int = 7) -> float:
    """Host microseconds per call of ``fn``: the GPU sleeps meanwhile, so launches only queue (40
    calls of a few launches stay below the launch queue's depth, where the host would block)."""
    import time
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(100_000_000)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def bench_host(hq: int, hkv: int, d: int = 128, bits: int = 4) -> list[dict]:
    """Host time of one layer's attention calls in a mixed step (the serving step's 144 decode rows
    and a 512-token prompt, queries and K/V as views into a fused QKV output): outside CUDA graphs
    the host launches these for every layer, and the GPU waits if it falls behind. vLLM's
    FlashAttention calls on the same step for comparison, where vLLM is installed."""
    try:
        from vllm import _custom_ops as ops
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        ops = None

    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels.decode import longest_first, paged_decode, rows_per_program
    from vllm_kvcompress.triton_kernels.write import write_tokens

    fmt = _format(bits, hkv, d, 128)
    lens = serving_lens(144, 900)
    nd, prompt = len(lens), 512
    cache, table = _pages(fmt, nd + 1, 1024)
    t = nd + prompt
    q, k, v = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16).split(
        [hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    out = torch.empty(t, hq, d, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens + [prompt], dtype=torch.int32, device="cuda")
    starts = list(range(nd + 1)) + [t]
    starts_dev = torch.tensor(starts, dtype=torch.int32, device="cuda")
    slots = torch.cat([table[:nd, 0].long() * 128 + 5,
                       table[nd, :4].long().repeat_interleave(128) * 128 + torch.arange(prompt, device="cuda") % 128])
    def build_rows():
        return token_rows([x - nd for x in starts[nd:]], [0], table[nd:], rows_per_program(hq // hkv))
    rows = build_rows()
    k_cache = torch.randn(t * 64, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    flat_table = (torch.arange((nd + 1) * 64, device="cuda", dtype=torch.int32) % k_cache.shape[0]).view(nd + 1, 64)
    one = torch.ones((), device="cuda")
    cases = {
        f"ours k{bits}v{bits}: cache write (K and V)": lambda: write_tokens(cache, fmt, k, v, slots),
        f"ours k{bits}v{bits}: decode rows": lambda: paged_decode(q[:nd], cache, fmt, table[:nd], seq_lens[:nd],
                                                                 d ** -0.5, 900, out=out[:nd]),
        f"ours k{bits}v{bits}: prompt rows": lambda: paged_decode(q[nd:], cache, fmt, rows.block_table, rows.seq_lens,
                                                                 d ** -0.5, prompt, out=out[nd:], groups=rows.groups),
    }
    if ops is not None:
        cases |= {
            "vLLM FlashAttention bf16: cache write": lambda: ops.reshape_and_cache_flash(
                k, v, k_cache, v_cache, slots, "auto", one, one),
            "vLLM FlashAttention bf16: attention": lambda: flash_attn_varlen_func(
                q, k_cache, v_cache, max_seqlen_q=prompt, cu_seqlens_q=starts_dev, max_seqlen_k=900,
                seqused_k=seq_lens, softmax_scale=d ** -0.5, causal=True, block_table=flat_table, out=out,
                fa_version=3),
        }
    from vllm_kvcompress.kernels import registry
    if registry.why_no_cuda_kernels_here() is None:  # what the backend launches
        from vllm_kvcompress import cuda_decode, cuda_write
        order = longest_first(seq_lens[:nd])
        cases[f"ours k{bits}v{bits}: cache write (K and V), CUDA"] = lambda: cuda_write.write_tokens(
            cache, fmt, k, v, slots)
        cases[f"ours k{bits}v{bits}: decode rows, CUDA"] = lambda: cuda_decode.paged_decode(
            q[:nd], cache, fmt, table[:nd], seq_lens[:nd], d ** -0.5, 900, out=out[:nd], row_order=order)
    once_a_step = {"kernel": "ours: token_rows (once a step)", "host_us": _host_us(build_rows, calls=4)}
    return [{"kernel": name, "host_us": _host_us(fn)} for name, fn in cases.items()] + [once_a_step]


def bench_slim_step(lens: list[int], h: int, d: int, block: int = 128, tunings=(), k_bits: int = 16) -> list[dict]:
    """Slim attention's decode rows over K-only pages of ``k_bits`` (``lens``: each row's context), in
    parts (scores, mix, the W_KV product), beside vLLM's FlashAttention over bf16 K and V pages of
    the same contexts. ``tunings``: also the whole decode at these ((tile, warps, stages) of the
    scores pass, the same of the mix pass)."""
    from vllm_kvcompress.config import LayerFormat
    from vllm_kvcompress.formats import KVPageFormat
    from vllm_kvcompress.slim import Rotary, SlimLayer
    from vllm_kvcompress.triton_kernels import slim_decode as sd

    fmt = KVPageFormat.from_layer_format(LayerFormat(k_only=True, k_bits=k_bits), torch.bfloat16, block, h, d)
    n, ctx = len(lens), max(lens)
    cache, table = _pages(fmt, n, ctx)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16)
    angles = torch.arange(ctx, device="cuda")[:, None] * 10000.0 ** (-torch.arange(0, d, 2, device="cuda") / d)
    rotary = Rotary(torch.cat([angles.cos(), angles.sin()], -1).to(torch.bfloat16), d, True)
    slim = SlimLayer(torch.randn(h, h * d, d, device="cuda", dtype=torch.bfloat16) / (h * d) ** 0.5, rotary)
    out = torch.empty_like(q)
    scores = torch.empty((n, h, -(-ctx // 16) * 16), dtype=torch.float32, device="cuda")
    stats = torch.empty((n, h, 2), dtype=torch.float32, device="cuda")
    mixed = torch.empty(h, n, h * d, dtype=torch.bfloat16, device="cuda")

    cases = {"slim decode (scores, mix, W_KV product)": lambda: sd.slim_decode(q, cache, fmt, table, seq_lens,
                                                                               d ** -0.5, ctx, slim, out=out),
             "  scores pass": lambda: sd.scores_pass(q, cache, fmt, table, seq_lens, d ** -0.5, scores, stats),
             "  mix pass": lambda: sd.mix_pass(scores, stats, cache, fmt, table, seq_lens, rotary.cos_sin, mixed),
             "  W_KV product": lambda: torch.bmm(mixed, slim.w_heads)}
    for scores_tuning, mix_tuning in tunings:
        cases[f"slim decode, scores {scores_tuning}, mix {mix_tuning}"] = lambda a=scores_tuning, b=mix_tuning: (
            sd.slim_decode(q, cache, fmt, table, seq_lens, d ** -0.5, ctx, slim, out=out, scores_tuning=a,
                           mix_tuning=b))
    rows = [{"kernel": f"K{k_bits}: {name}", "ms": _time_ms(fn)} for name, fn in cases.items()]
    return rows + ([bench_flash_bf16(n, h, h, d, ctx, lens=lens)] if k_bits == 16 else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true",
                    help="also try kernel variants (tile, pipeline stages, warps, programs per SM) at 4/4 and 8/8 bits")
    ap.add_argument("--write-chunks", nargs="*", type=int, default=[], metavar="CHANNELS",
                    help="also time the 4/4 write with these chunks of channels per program")
    ap.add_argument("--write-spreads", nargs="*", type=int, default=[], metavar="PROGRAMS",
                    help="also time the 4/4 write with a block's chunks dealt out over these many programs")
    ap.add_argument("--write-warps", nargs="*", type=int, default=[], metavar="WARPS",
                    help="also time the 4/4 write with these warps per program")
    ap.add_argument("--write-cuda", action="store_true",
                    help="also time the CUDA write kernel (csrc/; needs nvcc or the prebuilt kernels, see docs/gpu.md)")
    ap.add_argument("--scaling", action="store_true", help="also 4/4 bits and bf16 over batch and context sizes")
    ap.add_argument("--host", action="store_true",
                    help="only the host time of a mixed step's attention calls for one layer, ours and (where "
                         "installed) vLLM's")
    ap.add_argument("--serving", action="store_true",
                    help="also a serving step's decode rows (144 requests, contexts uniform in 16..900, see "
                         "serving_lens) with kernel variants, and prefill chunks after history")
    ap.add_argument("--prompts", action="store_true",
                    help="only prompt chunks (with and without history, up to an 8k prompt's last chunk): vLLM's "
                         "FlashAttention prefill on bf16 pages against ours")
    ap.add_argument("--prompt-tunings", nargs="*", default=[], metavar="ROWS,WARPS,STAGES,TILE",
                    help="with --prompts: also the history kernel with these rows a program, warps, pipeline "
                         "stages and tokens a tile (4/4 bits)")
    ap.add_argument("--step-parts", action="store_true",
                    help="with --step: also the step without the write, the decode alone and the write alone")
    ap.add_argument("--step", action="store_true",
                    help="only a decode step's cache write and decode for 32 layers in a CUDA graph (us a layer; "
                         "CUDA kernels: nvcc or prebuilt): a serving step's 144 rows and a run's tail of 3 and 8 rows")
    ap.add_argument("--step-splits", nargs="*", type=int, default=[], metavar="SPLITS",
                    help="with --step: also the MHA decode alone of 3 to 40 rows with these split counts")
    ap.add_argument("--presets", nargs="*", default=[], metavar="PRESET",
                    help="only these presets' decode rows and decode-step write (Triton, and CUDA where it serves)")
    ap.add_argument("--preset-tunings", nargs="*", default=[], metavar="TILE,WARPS,STAGES",
                    help="with --presets: also their decode rows at these tunings")
    ap.add_argument("--minicache", action="store_true",
                    help="MiniCache's merged pair of layers in parts (decode, write), beside two 4-bit layers")
    ap.add_argument("--zipcache", action="store_true",
                    help="only ZipCache's attention of a layer in parts (kernel, probe scores and re-compression) "
                         "against the 4-bit preset's, a serving step's decode rows and prompt chunks")
    ap.add_argument("--zipcache-rows", nargs="*", type=int, default=[144], metavar="ROWS",
                    help="with --zipcache: these counts of decode rows (contexts 16..900)")
    ap.add_argument("--split-rows", action="store_true",
                    help="only ZipCache's MHA decode over split-row pages, beside the slot-map pages' and quant-k4v4's")
    ap.add_argument("--slim", action="store_true",
                    help="only slim attention's decode rows over K-only pages in parts, against vLLM's "
                         "FlashAttention bf16 (MHA 32 heads of 128; 72 and 144 rows of contexts 16..900; 8-bit K "
                         "at 144)")
    ap.add_argument("--slim-tunings", nargs="*", default=[], metavar="TILE,WARPS,STAGES,TILE,WARPS,STAGES",
                    help="with --slim: also the decode with these tiles, warps and pipeline stages of the scores "
                         "pass, then of the mix pass")
    ap.add_argument("--profile", nargs=3, type=int, metavar=("BITS", "HQ", "HKV"),
                    help="only launch that decode a few times (for a profiler such as ncu)")
    ap.add_argument("--profile-write", nargs=2, type=int, metavar=("BITS", "HKV"),
                    help="only run the decode step's cache write a few times (for a profiler such as ncu)")
    args = ap.parse_args()
    if args.host:
        for name, hq, hkv, _ in SHAPES:
            for r in bench_host(hq, hkv):
                print(f"{name:24s} {r['kernel']:42s} {r['host_us']:6.1f} us of host time a call")
        return
    if args.presets:
        tunings = [dict(zip(("tile", "num_warps", "num_stages"), map(int, t.split(",")))) for t in args.preset_tunings]
        for name, hq, hkv, d in SHAPES:
            for preset in args.presets:
                for r in bench_preset_step(preset, serving_lens(144, 900), hq, hkv, d, tunings=tunings):
                    print(f"{name:24s} {preset:16s} {r['kernel']:40s} {r['ms'] * 1e3:8.1f} us")
        return
    if args.minicache:
        for name, hq, hkv, d in SHAPES:
            for r in bench_minicache_step(serving_lens(144, 900), hq, hkv, d):
                print(f"{name:24s} {r['kernel']:80s} {r['ms'] * 1e3:8.1f} us")
        return
    if args.slim:
        tunings = [(v[:3], v[3:]) for v in (tuple(map(int, t.split(","))) for t in args.slim_tunings)]
        for rows, k_bits in ((72, 16), (144, 16), (144, 8)):
            for r in bench_slim_step(serving_lens(rows, 900), 32, 128, tunings=tunings, k_bits=k_bits):
                print(f"MHA 32/32, {rows} rows     {r['kernel']:60s} {r['ms'] * 1e3:8.1f} us")
        return
    if args.split_rows:
        for rows in (144, 8):
            for r in bench_split_rows(serving_lens(rows, 900)):
                print(f"MHA 32/32 {r['kernel']:80s} {r['ms'] * 1e3:8.1f} us")
        return
    if args.zipcache:
        for name, hq, hkv, d in SHAPES:
            for rows in args.zipcache_rows:
                for r in bench_zipcache_step(serving_lens(rows, 900), hq, hkv, d):
                    print(f"{name:24s} {r['kernel']:80s} {r['ms'] * 1e3:8.1f} us")
        return
    if args.step:
        cases = (("serving step, 144 rows", serving_lens(144, 900)), ("tail, 8 rows", serving_lens(8, 2000, seed=3)),
                 ("tail, 3 rows", serving_lens(3, 1500, seed=4)))
        part_sets = [STEP_PARTS] + ([("copies", "decode"), ("decode",), ("write",)] if args.step_parts else [])
        for name, hq, hkv, _ in SHAPES:
            for label, lens in cases:
                for parts in part_sets:
                    r = bench_step_layers(4, lens, hq, hkv, parts=parts)
                    print(f"{name:24s} {label:24s} {' + '.join(parts):24s} {r['ms'] * 1e3:7.1f} us a layer, "
                          f"{r['GB/s']:6.0f} GB/s of pages")
        if args.step_splits:
            few_rows = cases[1:] + (("16 rows", serving_lens(16, 1500, seed=5)),
                                    ("40 rows", serving_lens(40, 1150, seed=6)))
            for label, lens in few_rows:
                for splits in [None, *args.step_splits]:
                    r = bench_step_layers(4, lens, 32, 32, parts=("decode",), num_splits=splits)
                    count = f"{r['splits']}{'' if splits else ' (chosen)'}"
                    print(f"{'MHA decode':24s} {label:24s} {count:>12} splits {r['ms'] * 1e3:7.1f} us a layer, "
                          f"{r['GB/s']:6.0f} GB/s of pages")
        return
    if args.prompts:
        for name, hq, hkv, d in SHAPES:
            for num_prompts, prompt, history in ((8, 512, 1536), (4, 1024, 3072), (32, 128, 0), (1, 2048, 5952),
                                                 (2, 2048, 3904), (16, 32, 2016), (8, 64, 1984), (8, 128, 1920), (8, 256, 1792),
                                                 (1, 8192, 16384)):
                base = bench_flash_prefill_bf16(num_prompts, hq, hkv, d, prompt, history)
                shape = f"{name} {num_prompts}x{prompt} after {history}"
                print(f"{shape:34s} {base['kernel']:42s} {base['ms'] * 1e3:7.1f} us", flush=True)
                routes = ("serving", "history", "decode-kernel") if history else ("serving",)
                variants = [(4, {"route": route}) for route in routes] + [(2, {"route": "serving"})] + [
                    (4, dict(route="decode-kernel", **dict(zip(("prompt_rows", "num_warps", "num_stages", "tile"),
                                                               map(int, t.split(","))))))
                    for t in args.prompt_tunings]
                for bits, tuning in variants:
                    if len(tuning) > 1 and not history:
                        continue  # tunings of the decode kernel's route
                    label = f"ours k{bits}v{bits}" + "".join(f" {k}={v}" for k, v in tuning.items())
                    try:
                        r = bench_prompt_chunks(bits, num_prompts, hq, hkv, d, prompt, history, **tuning)
                    except Exception as e:  # a tuning the compiler cannot fit (shared memory, registers)
                        print(f"{shape:34s} {label:42s} failed: {str(e).splitlines()[0][:80]}", flush=True)
                        continue
                    print(f"{shape:34s} {label:42s} {r['ms'] * 1e3:7.1f} us, {base['ms'] / r['ms']:5.2f}x "
                          "FlashAttention bf16", flush=True)
        return
    if args.profile_write:
        bits, hkv = args.profile_write
        bench_write(bits, args.batch, hkv, 128)
        return
    if args.profile:
        from vllm_kvcompress.triton_kernels.decode import paged_decode
        bits, hq, hkv = args.profile
        fmt, cache, table, q, seq_lens, _ = _decode_case(bits, args.batch, hq, hkv, 128, args.ctx, 128)
        for _ in range(3):
            paged_decode(q, cache, fmt, table, seq_lens, 128 ** -0.5, args.ctx)
        torch.cuda.synchronize()
        return
    copy = copy_bandwidth_gbs()
    rows = []
    for name, hq, hkv, d in SHAPES:
        base = bench_flash_bf16(args.batch, hq, hkv, d, args.ctx) | {"shape": name}
        rows.append(base)
        for bits in (8, 4, 2, 3):
            rows.append(bench_ours(bits, args.batch, hq, hkv, d, args.ctx) | {"shape": name})
        if args.sweep:
            for bits, variant in ((4, {"tile": 64}), (4, {"num_stages": 3}), (4, {"num_stages": 7}),
                                  (4, {"num_warps": 2}), (4, {"num_warps": 4}), (8, {"num_warps": 2}),
                                  (8, {"num_warps": 4}), (2, {"num_warps": 2}), (2, {"num_warps": 4})):
                rows.append(bench_ours(bits, args.batch, hq, hkv, d, args.ctx, **variant) | {"shape": name})
        for bits in (4, 8, 2):
            rows.append(bench_write(bits, args.batch, hkv, d) | {"shape": name})
        rows.append(bench_write_prefill(4, 16, hkv, d) | {"shape": name})
        rows.append(bench_write_mixed(4, 144, 2, 450, hkv, d) | {"shape": name})
        rows.append(bench_write(4, 144, hkv, d, steps=32) | {"shape": name})
        if args.write_cuda:
            for bits in (4, 8, 2):
                rows.append(bench_write(bits, args.batch, hkv, d, cuda=True) | {"shape": name})
            rows.append(bench_write_prefill(4, 16, hkv, d, cuda=True) | {"shape": name})
            rows.append(bench_write_mixed(4, 144, 2, 450, hkv, d, cuda=True) | {"shape": name})
            rows.append(bench_write(4, 144, hkv, d, cuda=True, steps=32) | {"shape": name})
        for chunk in args.write_chunks:
            rows.append(bench_write(4, args.batch, hkv, d, chunk_channels=chunk) | {"shape": name})
        for spread in args.write_spreads:
            rows.append(bench_write(4, args.batch, hkv, d, spread=spread) | {"shape": name})
        for warps in args.write_warps:
            rows.append(bench_write(4, args.batch, hkv, d, num_warps=warps) | {"shape": name})
        for r in rows:
            if r["shape"] == name and r["kernel"].startswith("ours"):
                r["speedup_vs_bf16"] = base["ms"] / r["ms"]
    if args.scaling:
        name, hq, hkv, d = SHAPES[1]
        # (128, 512): a serving step's decode rows on ShareGPT at 2048 tokens, where programs hold a
        # few tiles each and the pipeline's depth (shared memory per program) may cost more than it hides
        for batch, ctx, variants in ((16, 4096, [{}]), (256, 4096, [{}]), (64, 1024, [{}]), (64, 16384, [{}]),
                                     (128, 512, [{}, {"num_stages": 3}, {"num_stages": 2}, {"tile": 64}])):
            base = bench_flash_bf16(batch, hq, hkv, d, ctx) | {"shape": f"{name} b{batch} ctx{ctx}"}
            rows.append(base)
            for variant in variants:
                ours = bench_ours(4, batch, hq, hkv, d, ctx, **variant) | {"shape": base["shape"]}
                ours["speedup_vs_bf16"] = base["ms"] / ours["ms"]
                rows.append(ours)
    if args.serving:
        lens = serving_lens(144, 900)
        for name, hq, hkv, d in SHAPES:
            shape = f"{name} serving step"
            base = bench_flash_bf16(len(lens), hq, hkv, d, max(lens), lens=lens) | {"shape": shape}
            rows.append(base)
            for bits, variant in ((4, {}), (4, {"as_drawn": True}), (8, {}), (8, {"as_drawn": True}), (2, {}),
                                  (4, {"num_stages": 3}), (4, {"num_warps": 2}),
                                  (4, {"num_warps": 4}), (8, {"num_warps": 2}), (8, {"num_warps": 4}),
                                  (2, {"num_warps": 2}), (2, {"num_warps": 4})):
                ours = bench_ours(bits, len(lens), hq, hkv, d, max(lens), lens=lens, **variant) | {"shape": shape}
                ours["speedup_vs_bf16"] = base["ms"] / ours["ms"]
                rows.append(ours)
            shape = f"{name} prompts 8x512 after 1536"
            base = bench_flash_prefill_bf16(8, hq, hkv, d, 512, 1536) | {"shape": shape}
            rows.append(base)
            for bits in (4, 2):
                ours = bench_prompt_chunks(bits, 8, hq, hkv, d, 512, 1536) | {"shape": shape}
                ours["speedup_vs_bf16"] = base["ms"] / ours["ms"]
                rows.append(ours)
    for r in rows:
        r["of_copy_bw"] = r["GB/s"] / copy
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {copy:.0f} GB/s")
    print(f"batch {args.batch}, context {args.ctx}, head size 128 unless the shape says otherwise")
    print(f"{'shape':34s} {'kernel':40s} {'block':>5s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s} {'x bf16':>7s}")
    for r in rows:
        print(f"{r['shape']:34s} {r['kernel']:40s} {r['block']:5d} {r['ms'] * 1e3:8.1f} {r['GB/s']:7.0f} "
              f"{100 * r['of_copy_bw']:5.0f}% {r.get('speedup_vs_bf16', 1.0):7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy, "batch": args.batch,
                       "ctx": args.ctx, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
