"""The Triton decode kernel against the torch reference of the same pages.

Runs on the CPU in Triton's interpreter (small shapes) and, where a GPU is
present, on the GPU with the same and larger shapes.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from vllm_kvcompress import paged_torch  # noqa: E402
from vllm_kvcompress.config import LayerFormat  # noqa: E402
from vllm_kvcompress.formats import KVPageFormat  # noqa: E402
from vllm_kvcompress.triton_kernels.decode import paged_decode  # noqa: E402
from paged_cases import PACKED_FORMATS, fill_pages, format_id, free_before  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = PACKED_FORMATS + [LayerFormat(k_bits=16, v_bits=4), LayerFormat(k_bits=8, v_bits=16), LayerFormat(),
                            LayerFormat(k_bits=3, v_bits=2, outlier_tokens=1),
                            LayerFormat(k_bits=2, v_bits=2, outlier_tokens=2)]


@pytest.mark.parametrize("layer_format", FORMATS, ids=format_id)
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("block,tile", [(16, None), (32, 16)], ids=["tile=page", "2-tiles-per-page"])
@pytest.mark.parametrize("HQ", [4, 2], ids=["GQA", "MHA"])  # MHA: the softmax of one query row a program
def test_decode_equals_reference_small(layer_format, num_splits, block, tile, HQ):
    B, H, D = block, 2, 64
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = KVPageFormat.from_layer_format(layer_format, dtype, B, H, D)
    seq_lens = [1, 17, 40, 16, 70]
    cache, table = fill_pages(fmt, seq_lens, 3, seed=num_splits)
    q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(5)).to(dtype)
    ref = paged_torch.attend(q.float(), cache, fmt, list(range(len(seq_lens) + 1)), seq_lens, table, D ** -0.5)
    got = paged_decode(q.to(DEVICE), cache.to(DEVICE), fmt, table.to(DEVICE),
                       torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), D ** -0.5, max(seq_lens),
                       num_splits=num_splits, tile=tile)
    # fp16 tensor-core products of (q * scale) with integer codes: ~1e-3 relative
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("HQ", [4, 2], ids=["GQA", "MHA"])
def test_outlier_tokens_are_read_from_their_slots(num_splits, HQ):
    """Pages whose first token is a strong outlier (an attention sink): the kernel reads each block's
    outliers from their slots (8-bit K, 4-bit V rows) and leaves them out of the codes, as the
    reference does. The codes alone (the outliers' rows repeat another token's) give a clearly
    different answer."""
    B, H, D = 16, 2, 64
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=2, v_bits=2, outlier_tokens=2), dtype, B, H, D)
    seq_lens = [40, 17, 33]
    gen = torch.Generator().manual_seed(num_splits)
    cache, table = fill_pages(fmt, seq_lens, 2, seed=7)
    q = torch.randn(len(seq_lens), HQ, D, generator=gen).to(dtype)
    k_sink = 4 * torch.randn(len(seq_lens), H, D, generator=gen)
    for i in range(len(seq_lens)):  # rewrite each request's first block with a sink at token 0
        pages = cache[table[i, :1].long()]
        k, v = fmt.decode(pages)
        k[0, 0] = k_sink[i] + (q[i].float().reshape(H, -1, D).mean(1) * 3)  # a key the query attends to
        cache[table[i, :1].long()] = fmt.encode(k, v, torch.tensor([B]))
    assert (fmt.outlier_index(cache[table[:, 0].long()])[:, :, 0] == 0).all()
    args = (list(range(len(seq_lens) + 1)), seq_lens, table, D ** -0.5)
    ref = paged_torch.attend(q.float(), cache, fmt, *args)
    got = paged_decode(q.to(DEVICE), cache.to(DEVICE), fmt, table.to(DEVICE),
                       torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), D ** -0.5, max(seq_lens),
                       num_splits=num_splits)
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    codes_only = KVPageFormat(fmt.k, fmt.v, B, dtype)  # the same codes, no slots
    plain = paged_torch.attend(q.float(), cache[:, :codes_only.codes_bytes], codes_only, *args)
    assert (plain - ref).abs().max() > 0.2


@pytest.mark.parametrize("layer_format", [LayerFormat(k_bits=4, v_bits=4), LayerFormat(k_bits=2, v_bits=2,
                                                                                       outlier_tokens=2)],
                         ids=format_id)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("block,tile", [(16, None), (32, 16)], ids=["tile=page", "2-tiles-per-page"])
@pytest.mark.parametrize("HQ", [4, 2], ids=["GQA", "MHA"])
def test_sliding_window_decode_equals_reference(layer_format, num_splits, block, tile, HQ):
    """A sliding-window layer's decodes (window 21: the newest 21 keys, starting inside a page, past
    a tile or at 0) equal the reference's, though every page wholly before a window reads as NaN
    (vLLM has freed it). Whole contexts give another answer."""
    B, H, D, window = block, 2, 64, 21
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = KVPageFormat.from_layer_format(layer_format, dtype, B, H, D)
    seq_lens = [1, 17, 40, 21, 70, 58]
    cache, table = fill_pages(fmt, seq_lens, 2, seed=4)
    first_keys = [L - window for L in seq_lens]
    cache, table = free_before(cache, table, first_keys, B)
    q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(9)).to(dtype)
    args = (list(range(len(seq_lens) + 1)), seq_lens, table, D ** -0.5)
    ref = paged_torch.attend(q.float(), cache, fmt, *args, sliding_window=window)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    got = paged_decode(q.to(DEVICE), cache.to(DEVICE), fmt, table.to(DEVICE), lens, D ** -0.5, max(seq_lens),
                       num_splits=num_splits, tile=tile, window=window,
                       first_keys=torch.tensor(first_keys, dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    whole_cache, whole_table = fill_pages(fmt, seq_lens, 2, seed=4)
    whole = paged_torch.attend(q.float(), whole_cache, fmt, args[0], seq_lens, whole_table, D ** -0.5)
    assert (whole - ref)[[2, 4, 5]].abs().amax((1, 2)).min() > 0.05  # the rows longer than the window


@pytest.mark.parametrize("num_splits", [1, 2])
def test_rows_taken_longest_first_equal_reference(num_splits):
    """With ``row_order`` (``longest_first``: rows by decreasing context), program i takes row
    order[i] and each row's output still lands in its own place. An order that names row 0 twice
    and row 1 never shows that the programs follow it: unsplit, row 1's output is never written
    (split, the merge kernel goes over every row)."""
    from vllm_kvcompress.triton_kernels.decode import longest_first
    B, H, HQ, D = 16, 2, 4, 64
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), dtype, B, H, D)
    seq_lens = [5, 40, 17, 33]
    cache, table = fill_pages(fmt, seq_lens, 2, seed=12)
    q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    ref = paged_torch.attend(q.float(), cache, fmt, list(range(len(seq_lens) + 1)), seq_lens, table, D ** -0.5)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    order = longest_first(lens)
    assert order.dtype == torch.int32 and order.tolist() == [1, 3, 2, 0]
    args = (q.to(DEVICE), cache.to(DEVICE), fmt, table.to(DEVICE), lens, D ** -0.5, max(seq_lens))
    got = paged_decode(*args, num_splits=num_splits, row_order=order)
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    if num_splits == 1:
        out = torch.full_like(q, float("nan"), device=DEVICE)
        paged_decode(*args, num_splits=1, out=out, row_order=torch.tensor([0, 0, 2, 3], dtype=torch.int32,
                                                                          device=DEVICE))
        assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()


def test_split_launches_share_one_partials_buffer():
    """A step's layers launch one after another on one stream, so their split partials share one
    buffer (no allocation a layer): two layers' launches of different batches, each merged before
    the next writes, both equal the reference, and the second took its partials from the first's
    buffer, grown only for a larger split count asked for explicitly."""
    from vllm_kvcompress.triton_kernels import decode
    B, H, HQ, D = 16, 2, 4, 64
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), dtype, B, H, D)
    starts = []
    for layer, (seq_lens, num_splits) in enumerate((([70, 5, 33], 2), ([40, 17], 2), ([64, 9, 50, 3], 4))):
        cache, table = fill_pages(fmt, seq_lens, 1, seed=20 + layer)
        q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(layer)).to(dtype)
        ref = paged_torch.attend(q.float(), cache, fmt, list(range(len(seq_lens) + 1)), seq_lens, table, D ** -0.5)
        query, _, out = decode.query_and_output(q.to(DEVICE), None)
        run = decode.split_launch(query, out, fmt, max(seq_lens), num_splits)
        starts.append((run.part.data_ptr(), run.part.untyped_storage().nbytes()))
        got = paged_decode(q.to(DEVICE), cache.to(DEVICE), fmt, table.to(DEVICE),
                           torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), D ** -0.5, max(seq_lens),
                           num_splits=num_splits)
        torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    assert starts[1] == starts[0]
    needed = 4 * HQ * 4 * (D + 2) * 4  # the third launch's partials, in bytes
    assert starts[2][1] >= needed and (starts[2] == starts[0] or starts[0][1] < needed)


def test_row_strided_and_misaligned_views_equal_reference():
    """Queries and outputs as row-strided views (rows wider than the heads, as in a fused QKV
    output), first 16-byte aligned, then at an odd element offset: on the GPU the kernel compiled
    (and launched directly) for aligned pointers must not be reused for the misaligned ones."""
    B, H, HQ, D = 16, 2, 4, 64
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), dtype, B, H, D)
    seq_lens = [5, 40, 17]
    cache, table = fill_pages(fmt, seq_lens, 2, seed=9)
    q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = paged_torch.attend(q.float(), cache, fmt, list(range(len(seq_lens) + 1)), seq_lens, table, D ** -0.5)
    cache, table = cache.to(DEVICE), table.to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    width = HQ * D + 8
    for offset in (0, 0, 1):  # the second aligned call launches the kept kernel
        q_buf = torch.zeros(len(seq_lens) * width + offset, dtype=dtype, device=DEVICE)
        q_view = q_buf[offset:].view(len(seq_lens), width)[:, :HQ * D].view(len(seq_lens), HQ, D)
        q_view.copy_(q)
        out_buf = torch.full_like(q_buf, float("nan"))
        out = out_buf[offset:].view(len(seq_lens), width)[:, 8:].view(len(seq_lens), HQ, D)
        paged_decode(q_view, cache, fmt, table, lens, D ** -0.5, max(seq_lens), num_splits=1, out=out)
        torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
        assert out_buf[offset:].view(len(seq_lens), width)[:, :8].isnan().all()  # nothing outside the rows


def test_a_fused_qkv_view_is_read_in_place():
    """The queries' view into a fused QKV output reaches the kernel as it is, with its row stride
    (copying it cost a kernel and host time in every layer); only a view whose heads or channels
    are not contiguous within a row is copied."""
    from vllm_kvcompress.triton_kernels.decode import _row_strided
    qkv = torch.randn(5, (4 + 2 * 2) * 64)
    q = qkv[:, :4 * 64].view(5, 4, 64)
    seen, stride = _row_strided(q)
    assert seen is q and stride == qkv.shape[1]
    heads_apart = torch.randn(5, 4, 2, 64)[:, :, 0]
    seen, stride = _row_strided(heads_apart)
    assert seen is not heads_apart and seen.is_contiguous() and stride == 4 * 64


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_a_kept_variant_launches_without_the_jit(monkeypatch):
    """After its first launch a variant goes to the compiled kernel directly: Triton's JIT (its
    argument binding cost 28 us of host a launch) is not entered again, and the output is the same."""
    from vllm_kvcompress.triton_kernels import decode
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), torch.bfloat16, 16, 2, 64)
    seq_lens = [5, 40, 17]
    cache, table = fill_pages(fmt, seq_lens, 2, seed=6)
    cache, table = cache.cuda(), table.cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    q = torch.randn(len(seq_lens), 4, 64, dtype=torch.bfloat16).cuda()
    first = decode.paged_decode(q, cache, fmt, table, lens, 0.125, max(seq_lens), num_splits=1)
    jit_calls = []
    jit_run = decode._decode_kernel.run
    monkeypatch.setattr(decode._decode_kernel, "run", lambda *a, **kw: jit_calls.append(1) or jit_run(*a, **kw))
    again = decode.paged_decode(q, cache, fmt, table, lens, 0.125, max(seq_lens), num_splits=1)
    assert jit_calls == []
    assert torch.equal(again, first)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_decode_equals_reference_gpu(head_size, block_size, bits):
    H, HQ = 8, 32
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=bits, v_bits=bits), torch.bfloat16, block_size, H, head_size)
    seq_lens = [1, 300, 1000, 77, 513]
    cache, table = fill_pages(fmt, seq_lens, 5, seed=bits)
    q = torch.randn(len(seq_lens), HQ, head_size).to(torch.bfloat16)
    ref = paged_torch.attend(q.float(), cache, fmt, list(range(len(seq_lens) + 1)), seq_lens, table, head_size ** -0.5)
    got = paged_decode(q.cuda(), cache.cuda(), fmt, table.cuda(), torch.tensor(seq_lens, dtype=torch.int32).cuda(),
                       head_size ** -0.5, max(seq_lens))
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)


def test_warm_up_compiles_every_variant_a_step_launches():
    """After ``warm_up``, decode steps of any shape (split or not, ordered decode rows or grouped
    prompt rows continuing a prior attention, block tables of another width) compile nothing: vLLM's JIT monitor would log each compile as a
    latency spike in the middle of serving. The format (5 KV heads, K8/V2, 32-token pages) is used
    by no other test, so no earlier test compiled its variants. On the CPU (interpreter, nothing is
    compiled) this checks that warm_up runs and leaves the pages as they were."""
    import triton

    from vllm_kvcompress.token_rows import TokenGroups
    from vllm_kvcompress.triton_kernels.decode import longest_first, rows_per_program, warm_up
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=8, v_bits=2), dtype, 32, 5, 64)
    seq_lens = [30, 30, 300]  # rows 0 and 1: one request's prompt tokens
    cache, table = fill_pages(fmt, seq_lens, 2, seed=11)
    table[0] = table[1]
    cache, table = cache.to(DEVICE), torch.nn.functional.pad(table, (0, 16 - table.shape[1])).to(DEVICE)
    q = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    two_groups = TokenGroups(torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE),
                             torch.tensor([0, 2], dtype=torch.int32, device=DEVICE), rows_per_program(10 // 5))
    prior = torch.zeros(10, 3, dtype=torch.float32, device=DEVICE)
    compiled = []
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        before = cache.clone()
        warm_up(cache, fmt, 10, dtype)
        assert torch.equal(cache, before)
        if DEVICE == "cuda":
            assert compiled.count("_decode_kernel") == 4 and "_merge_splits_kernel" in compiled, compiled
        compiled.clear()
        for num_splits in (None, 1, 4):  # decode rows come longest first (the backend's row_order)
            paged_decode(q, cache, fmt, table, lens, 0.125, max(seq_lens), num_splits=num_splits,
                         row_order=longest_first(lens))
            paged_decode(q, cache, fmt, table, lens, 0.125, max(seq_lens), num_splits=num_splits, groups=two_groups,
                         prior_lse=prior)
        assert compiled == []
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous


def _run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Emulates the PTX instructions of the decode kernel's unpacking (prmt.b32 in its default mode,
    lop3.b32, shl.b32) on 32-bit registers; ``$N`` operands come from ``inputs`` or are outputs."""
    import re
    regs = dict(inputs)

    def val(x):
        return int(x, 16) if x.startswith("0x") else int(x) if x.isdigit() else regs[x]

    for ins in (i.strip() for i in asm.strip("{} ").split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            a, b, sel = (val(x) for x in src)
            pool = (b << 32) | a  # bytes 0-3 from a, 4-7 from b
            regs[d] = sum(((pool >> (8 * ((sel >> 4 * i) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "lop3.b32":
            a, b, c, lut = (val(x) for x in src)
            regs[d] = sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i
                          for i in range(32))
        elif op == "shl.b32":
            a, n = (val(x) for x in src)
            regs[d] = (a << n) & 0xFFFFFFFF
        else:
            raise AssertionError(f"unexpected instruction {ins!r}")
    assert all(re.fullmatch(r"\$\d+|lo|hi|hlo|hhi|t", r) for r in regs)
    return regs


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_ptx_unpacking_equals_masked_fields(bits):
    """The PTX the GPU runs gives, for each of four packed bytes and each plane k, the float16 bits
    ``0x6400 | (byte & field k)``: 1024 + 2**(k*bits) * code, what the plain path computes. Element i
    of the four lands in half i % 2 of register i // 2 of its plane."""
    from vllm_kvcompress.triton_kernels.decode import _unpack_asm
    planes = 1 if bits == 8 else 8 // bits
    gen = torch.Generator().manual_seed(bits)
    words = torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64).tolist() + [0, 0xFFFFFFFF]
    for word in words:
        out = _run_ptx(_unpack_asm(bits), {f"${2 * planes}": word})
        packed = [(word >> 8 * i) & 0xFF for i in range(4)]
        for k in range(planes):
            field = ((1 << bits) - 1) << (k * bits)
            halves = [0x6400 | (b & field) for b in packed]
            assert out[f"${2 * k}"] == halves[0] | halves[1] << 16
            assert out[f"${2 * k + 1}"] == halves[2] | halves[3] << 16


def test_ptx_unpacking_of_3_bit_codes_equals_masked_fields():
    """3-bit codes (two planes, ``_code_planes``): for four 2-bit-plane bytes and the nibbles of their
    high bits, plane k of each byte is ``0x6400 | (byte & 3 << 2k) | (nibble bit k) << 2k + 2``, the
    plain path's float16 bits of 1024 + 4**k * code. Bits of the high byte past its nibble are ignored."""
    from vllm_kvcompress.triton_kernels.decode import _unpack3_asm
    gen = torch.Generator().manual_seed(3)
    words = torch.randint(0, 2**32, (64, 2), generator=gen, dtype=torch.int64).tolist() + [[0, 0], [0xFFFFFFFF] * 2]
    for low, high in words:
        out = _run_ptx(_unpack3_asm(), {"$8": low, "$9": high})
        lo = [(low >> 8 * i) & 0xFF for i in range(4)]
        hi = [(high >> 8 * i) & 0xFF for i in range(4)]
        for k in range(4):
            halves = [0x6400 | (b & 3 << 2 * k) | (n >> k & 1) << 2 * k + 2 for b, n in zip(lo, hi)]
            assert out[f"${2 * k}"] == halves[0] | halves[1] << 16
            assert out[f"${2 * k + 1}"] == halves[2] | halves[3] << 16


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("q_lens", [[1, 1, 37], [37], [5, 9]], ids=["decodes-and-a-prompt", "one-prompt", "two-prompts"])
def test_a_mixed_step_never_waits_for_the_gpu(q_lens):
    """token_rows, the decode rows' order from the host's lengths, the decode kernel, the prompt
    chunks' attention and the cache write queue their work without synchronizing with the GPU
    (torch raises on a synchronizing call in this mode): the host must stay ahead, launching the
    step's layers while the GPU works. One prompt alone once made token_rows read a repeat count
    back to the host."""
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels.decode import longest_first, rows_per_program
    from vllm_kvcompress.triton_kernels.prompt import paged_prompt
    from vllm_kvcompress.triton_kernels.write import write_tokens
    B, H, HQ, D = 16, 2, 4, 64
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), torch.bfloat16, B, H, D)
    seq_lens = [n + 20 for n in q_lens]
    cache, table = fill_pages(fmt, seq_lens, 2, seed=4)
    positions = [torch.arange(L - n, L) for L, n in zip(seq_lens, q_lens)]  # the new tokens'
    slots = torch.cat([table[r, p // B].long() * B + p % B for r, p in enumerate(positions)]).cuda()
    cache, table = cache.cuda(), table.cuda()
    nd = q_lens.count(1)
    qsl = [0]
    for n in q_lens[nd:]:
        qsl.append(qsl[-1] + n)
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    q = torch.randn(nd + qsl[-1], HQ, D, dtype=torch.bfloat16).cuda()
    kv = torch.randn(nd + qsl[-1], H, D, dtype=torch.bfloat16).cuda()
    order = torch.full((len(q_lens),), -1, dtype=torch.int32, device="cuda")
    for _ in range(2):  # the second time through the kept compiled kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            longest_first(torch.tensor(seq_lens, dtype=torch.int32), out=order)
            write_tokens(cache, fmt, kv, kv, slots)
            if nd:  # the decodes are of equal length: any order of them
                paged_decode(q[:nd], cache, fmt, table[:nd], lens[:nd], D ** -0.5, max(seq_lens[:nd]),
                             row_order=torch.arange(nd, dtype=torch.int32, device="cuda"))
            rows = token_rows(qsl, [20] * (len(q_lens) - nd), table[nd:], rows_per_program(HQ // H))
            paged_prompt(q[nd:], kv[nd:], kv[nd:], cache, fmt, rows, D ** -0.5, out=torch.empty_like(q[nd:]))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sorted(order.tolist()) == list(range(len(q_lens)))
    assert [seq_lens[r] for r in order.tolist()] == sorted(seq_lens, reverse=True)


def test_a_steps_layers_share_one_plan_and_pass_their_own_pointers(monkeypatch):
    """The first layer of a step launches through ``launch`` (which compiles); the step's later
    layers launch the compiled decode and merge kernels directly, with the first layer's arguments
    but their own query, cache and output. Other lengths, or an output at another alignment (the
    kernel is specialized on it), get a plan of their own. Launches are stubbed: on the CPU nothing
    is compiled."""
    from vllm_kvcompress.launch_plans import LaunchPlans
    from vllm_kvcompress.triton_kernels import decode

    def pointers(args):
        return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)

    launched, ran = [], []

    class Compiled:
        def __init__(self, variant):
            self.variant = variant

        def run(self, grid, stream, args):
            ran.append((self.variant.kernel, grid, stream, args))

    def launch(variant, grid, args):
        launched.append((variant.kernel, tuple(grid) + (1,) * (3 - len(grid)), pointers(args)))
        return Compiled(variant)

    monkeypatch.setattr(decode, "plannable", lambda device: True)
    monkeypatch.setattr(decode, "stream_handle", lambda device: 7)
    monkeypatch.setattr(decode, "launch", launch)
    monkeypatch.setattr(decode, "_plans", LaunchPlans())
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), torch.float32, 16, 2, 64)
    table = torch.zeros(3, 4, dtype=torch.int32)
    lens = torch.tensor([5, 40, 17], dtype=torch.int32)
    layers = [(torch.randn(3, 4, 64), torch.zeros(4, fmt.page_bytes, dtype=torch.uint8), torch.empty(3, 4, 64))
              for _ in range(3)]
    for q, cache, out in layers:
        decode.paged_decode(q, cache, fmt, table, lens, 0.125, 40, num_splits=2, out=out)
    assert [kernel for kernel, _, _ in launched] == [decode._decode_kernel, decode._merge_splits_kernel]
    assert len(ran) == 4
    names = {decode._decode_kernel: decode._decode_kernel.arg_names,
             decode._merge_splits_kernel: decode._merge_splits_kernel.arg_names}
    own = {"q_ptr": 0, "cache_ptr": 1, "half_ptr": 1, "out_ptr": 2}  # a layer's tensor each argument points into
    for layer, (q, cache, out) in enumerate(layers[1:]):
        for (kernel, grid, args), (run_kernel, run_grid, stream, run_args) in zip(launched, ran[2 * layer:]):
            expected = tuple((q, cache, out)[own[name]].data_ptr() if name in own else arg
                             for name, arg in zip(names[kernel], args))
            assert (run_kernel, run_grid, stream, run_args) == (kernel, grid, 7, expected)
    q, cache, out = layers[0]
    decode.paged_decode(q, cache, fmt, table, lens, 0.125, 60, num_splits=2, out=out)
    assert len(launched) == 4
    shifted = torch.empty(3 * 4 * 64 + 1)[1:].view(3, 4, 64)
    decode.paged_decode(q, cache, fmt, table, lens, 0.125, 60, num_splits=2, out=shifted)
    assert len(launched) == 6 and len(ran) == 4
