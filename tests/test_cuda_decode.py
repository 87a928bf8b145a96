"""The CUDA decode kernel (4/4- and 2/2-bit pages, MHA and GQA) against the torch reference of the same pages.

Runs where a CUDA GPU and nvcc are present (the kernel is built just in time); the format checks
run everywhere.
"""

import pytest
import torch

from vllm_kvcompress import cuda_decode, cuda_jit, paged_torch
from vllm_kvcompress.config import LayerFormat
from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.kernels import registry
from c_structs import c_struct_fields, stub_launches
from paged_cases import fill_pages

FOUR = LayerFormat(k_bits=4, v_bits=4)
TWO = LayerFormat(k_bits=2, v_bits=2)


def _fmt(layer_format=FOUR, block=128, heads=4, head_size=128, dtype=torch.bfloat16):
    return KVPageFormat.from_layer_format(layer_format, dtype, block, heads, head_size)


def test_launch_arguments_mirror_the_kernels_struct():
    assert cuda_decode._DecodeArgs._fields_ == c_struct_fields("decode_kernel.cu", "DecodeArgs")


def test_a_steps_layers_share_one_plan_and_pass_their_own_pointers(monkeypatch):
    """The rows, lengths and order are planned once a step; each layer's call passes its own query,
    cache and output. A step with other lengths gets its own plan."""
    calls = []
    plans = stub_launches(monkeypatch, cuda_decode,
                          lambda args: calls.append({name: getattr(args, name) for name, _ in args._fields_}))
    fmt, n = _fmt(heads=2), 3
    table = torch.zeros(n, 8, dtype=torch.int32)
    lens, order = torch.tensor([5, 200, 17], dtype=torch.int32), torch.tensor([1, 2, 0], dtype=torch.int32)
    layers = [(torch.randn(n, 2, 128).to(torch.bfloat16), torch.zeros(4, fmt.page_bytes, dtype=torch.uint8),
               torch.empty(n, 2, 128, dtype=torch.bfloat16)) for _ in range(3)]
    for q, cache, out in layers:
        cuda_decode.paged_decode(q, cache, fmt, table, lens, 0.1, 200, out=out, row_order=order)
    assert len(plans) == 1
    for call, (q, cache, out) in zip(calls, layers):
        assert (call["query"], call["cache"], call["out"], call["part"]) == (
            q.data_ptr(), cache.data_ptr(), out.data_ptr(), out.data_ptr())
        assert (call["block_table"], call["seq_lens"], call["row_order"], call["num_rows"], call["table_blocks"],
                call["stream"]) == (table.data_ptr(), lens.data_ptr(), order.data_ptr(), n, 2, 7)
    cuda_decode.paged_decode(q, cache, fmt, table, lens, 0.1, 600, out=out, row_order=order)
    assert len(plans) == 2 and calls[-1]["table_blocks"] == 5


def test_split_count_gives_each_sm_four_programs(monkeypatch):
    """The fewest splits, a power of two, that give every SM ``PROGRAMS_PER_SM`` (4) programs, and no
    more than the longest context's 256-token pieces (rounded up to a power of two)."""
    decode = cuda_jit.triton_kernels("decode")
    sms = 132
    monkeypatch.setattr(decode, "_multiprocessors", lambda index: sms)
    cuda = torch.device("cuda", 0)
    # the counts measured fastest for 32 KV heads and contexts of up to 2048 tokens on a GPU of 132 SMs
    # (docs/benchmarks.md, split counts); one row takes 8 splits of 256 tokens, not 16 of 128
    measured_best = {3: 8, 5: 4, 12: 2, 16: 2, 24: 1, 40: 1}
    assert {n: cuda_decode.choose_num_splits(n, 32, 2048, cuda) for n in measured_best} == measured_best
    assert cuda_decode.choose_num_splits(1, 32, 2048, cuda) == 8
    for rows in range(1, 200, 3):
        for heads in (8, 32):
            for max_seq_len in (1, 128, 129, 2048, 32768):
                splits = cuda_decode.choose_num_splits(rows, heads, max_seq_len, cuda)
                pieces = -(-max_seq_len // 256)
                assert splits & (splits - 1) == 0 and splits < 2 * pieces
                assert splits == 1 or rows * heads * splits // 2 < 4 * sms
                assert rows * heads * splits >= 4 * sms or splits >= pieces or splits == decode.MAX_SPLITS


def _why_not(fmt, num_query_heads, dtype) -> str | None:
    """The registry's reason the CUDA decode does not serve ``fmt`` (None: it does)."""
    ctx = registry.LayerContext(registry.Device("cuda", (9, 0), nvcc=True), dtype, num_query_heads)
    return registry.implementations("decode", "cuda")[0].why_not(fmt, ctx)


gpu = pytest.mark.skipif(registry.why_no_cuda_decode_here() is not None,
                         reason=str(registry.why_no_cuda_decode_here()))


def _reference(q, cache, fmt, table, seq_lens, scale):
    return paged_torch.attend(q.float(), cache, fmt, list(range(len(seq_lens) + 1)), seq_lens, table, scale)


@gpu
@pytest.mark.parametrize("layer_format", [FOUR, TWO], ids=["4-4", "2-2"])
@pytest.mark.parametrize("group", [1, 2, 4], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 2, 3, None])
@pytest.mark.parametrize("seq_lens", [[1, 63, 64, 65, 127, 128, 129, 300], [1000, 17, 2049, 4096, 256]],
                         ids=["short", "long"])
@pytest.mark.parametrize("block", [128, 64])
def test_decode_equals_reference(layer_format, group, dtype, num_splits, seq_lens, block):
    """On 64-token pages a warp takes every other page rather than half of each; split counts 2 and 3
    give splits of odd page counts there."""
    fmt = _fmt(layer_format, block, heads=4, dtype=dtype)
    if _why_not(fmt, 4 * group, dtype):
        pytest.skip(_why_not(fmt, 4 * group, dtype))
    cache, table = fill_pages(fmt, seq_lens, 3, seed=len(seq_lens), garbage=True)
    q = torch.randn(len(seq_lens), 4 * group, 128, generator=torch.Generator().manual_seed(5)).to(dtype)
    ref = _reference(q, cache, fmt, table, seq_lens, 128 ** -0.5)
    got = cuda_decode.paged_decode(q.cuda(), cache.cuda(), fmt, table.cuda(),
                                   torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), 128 ** -0.5,
                                   max(seq_lens), num_splits=num_splits)
    # fp16 products of (q * scale) with integer codes, as the Triton kernel: ~1e-3 relative
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.parametrize("layer_format", [FOUR, TWO], ids=["4-4", "2-2"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block", [128, 64])
def test_rows_in_given_order_and_strided_views(layer_format, group, block):
    """``row_order`` (rows longest first, as the backend passes them) and a query and output that
    are views into wider rows (the fused QKV output) land each row in its own place."""
    seq_lens = [5, 700, 130, 1]
    fmt = _fmt(layer_format, block, heads=2)
    w = 2 * group * 128  # query heads x head size
    cache, table = fill_pages(fmt, seq_lens, 2, seed=9, garbage=True)
    qkv = torch.randn(len(seq_lens), 3 * w, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = qkv[:, :w].view(len(seq_lens), 2 * group, 128)
    ref = _reference(q, cache, fmt, table, seq_lens, 0.1)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out_rows = torch.zeros(len(seq_lens), 3 * w, dtype=torch.bfloat16, device="cuda")
    out = out_rows[:, w:2 * w].view(len(seq_lens), 2 * group, 128)
    cuda_decode.paged_decode(qkv.cuda()[:, :w].view(len(seq_lens), 2 * group, 128), cache.cuda(), fmt, table.cuda(),
                             lens, 0.1, max(seq_lens), out=out, row_order=torch.argsort(lens, descending=True).int())
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    assert out_rows[:, :w].abs().sum() == 0 and out_rows[:, 2 * w:].abs().sum() == 0


@gpu
@pytest.mark.parametrize("layer_format", [FOUR, TWO], ids=["4-4", "2-2"])
@pytest.mark.parametrize("group", [1, 4])
def test_matches_triton_kernel_closely(layer_format, group):
    """Both kernels compute the same fp16 products of the same scaled query and codes; they differ
    only in the order of float32 sums. (Unwritten slots hold zeros here, as in vLLM's cache.)"""
    from vllm_kvcompress.triton_kernels.decode import paged_decode
    seq_lens = [4096, 333, 1290, 77, 2000, 640]
    fmt = _fmt(layer_format, heads=8)
    cache, table = fill_pages(fmt, seq_lens, 1, seed=3)
    args = (torch.randn(len(seq_lens), 8 * group, 128).to(torch.bfloat16).cuda(), cache.cuda(), fmt, table.cuda(),
            torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), 128 ** -0.5, max(seq_lens))
    torch.testing.assert_close(cuda_decode.paged_decode(*args).float(), paged_decode(*args).float(),
                               rtol=1e-2, atol=1e-2)


@gpu
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("seq_lens", [[5, 127, 300], [1900]], ids=["three", "one"])
def test_write_then_decode_replayed_in_a_cuda_graph(group, seq_lens):
    """A decode step as vLLM's full CUDA graphs run it, for steps whose tokens advance: each layer makes
    its query, K and V (a copy), writes the new token, decodes (with splits and their merge: sized for
    2,048 tokens, as captured) and hands its output on (a copy). The write, decode and merge start
    before the kernel before them ends (dependent launches); each must still see what it came after."""
    from vllm_kvcompress import cuda_write
    fmt = _fmt(FOUR, heads=2)
    layers, steps, n, hq = 3, 3, len(seq_lens), 2 * group
    cache, table = fill_pages(fmt, [length + steps for length in seq_lens], 1, seed=4)
    gen = torch.Generator().manual_seed(11)
    made = torch.randn(steps, layers, n, hq + 4, 128, generator=gen).to(torch.bfloat16)
    source = torch.empty(layers, n, hq + 4, 128, dtype=torch.bfloat16, device="cuda").unbind(0)
    qkv = [torch.empty_like(x) for x in source]
    slots = torch.empty(n, dtype=torch.int64, device="cuda")
    lens = torch.empty(n, dtype=torch.int32, device="cuda")
    table_gpu = table.cuda()
    outs = [torch.empty(n, hq, 128, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    handed = [torch.empty_like(o) for o in outs]

    def positions(s):
        return torch.tensor(seq_lens) + s

    def slots_of(s):
        return table[torch.arange(n), positions(s) // 128].long() * 128 + positions(s) % 128

    def set_step(s):
        for layer in range(layers):
            source[layer].copy_(made[s, layer])
        slots.copy_(slots_of(s))
        lens.copy_(positions(s) + 1)

    def step(pages):
        for layer in range(layers):
            qkv[layer].copy_(source[layer])
            q, k, v = qkv[layer][:, :hq], qkv[layer][:, hq:hq + 2], qkv[layer][:, hq + 2:]
            cuda_write.write_tokens(pages[layer], fmt, k, v, slots)
            cuda_decode.paged_decode(q, pages[layer], fmt, table_gpu, lens, 128 ** -0.5, 2048, out=outs[layer])
            handed[layer].copy_(outs[layer])

    set_step(0)
    step([cache.cuda() for _ in range(layers)])  # builds the kernels outside capture
    pages = [cache.cuda() for _ in range(layers)]  # the pages before any step, for the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(pages)
    ref_cache = [cache.clone() for _ in range(layers)]
    for s in range(steps):
        set_step(s)
        graph.replay()
        for layer in range(layers):
            x = made[s, layer]
            paged_torch.write_tokens(ref_cache[layer], fmt, x[:, hq:hq + 2], x[:, hq + 2:], slots_of(s))
            ref = _reference(x[:, :hq], ref_cache[layer], fmt, table, (positions(s) + 1).tolist(), 128 ** -0.5)
            torch.testing.assert_close(handed[layer].float().cpu(), ref, rtol=2e-2, atol=2e-2)


def test_importing_the_cuda_kernels_leaves_triton_unimported():
    """Triton reads TRITON_INTERPRET when it is first imported; the CPU tests set it before importing
    the Triton kernels, so importing these modules (as the backend and other tests do) must not import it."""
    import subprocess
    import sys
    code = ("import sys, vllm_kvcompress.cuda_decode, vllm_kvcompress.cuda_write; "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
