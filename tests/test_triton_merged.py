"""The Triton kernels over MiniCache's merged pages against the torch reference of the same pages
(``MergedPairFormat.decode``, ``paged_torch.attend_pair``).

Runs on the CPU in Triton's interpreter and, where a GPU is present, on the GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from paged_cases import encoded_pages, request_slots  # noqa: E402
from vllm_kvcompress import paged_torch  # noqa: E402
from vllm_kvcompress.config import LayerFormat  # noqa: E402
from vllm_kvcompress.formats.merged import MergedLayer, MergedPairFormat  # noqa: E402
from vllm_kvcompress.token_rows import token_rows  # noqa: E402
from vllm_kvcompress.triton_kernels import merged_prompt, prompt  # noqa: E402
from vllm_kvcompress.triton_kernels.decode import paged_decode  # noqa: E402
from vllm_kvcompress.triton_kernels.merged_decode import decode_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
TOL = 1e-4 if DEVICE == "cpu" else 3e-2  # on the GPU, bfloat16 queries and TF32 products
CODES_TOL = 2e-2  # quantized directions: the layer decode kernel's products take float16 operands (test_triton_decode)
CODECS = {"16-bit": LayerFormat(), "k4v4": LayerFormat(k_bits=4, v_bits=4), "k2v8": LayerFormat(k_bits=2, v_bits=8)}


def _pair_vectors(g, n, B, H, D):
    """Both layers' K and V [n, B, H, D]: layer b's directions near layer a's, some tokens far off
    (the ones retention should keep), norms that differ between the layers."""
    ka, va = torch.randn(n, B, H, D, generator=g), torch.randn(n, B, H, D, generator=g) * 2
    kb = ka * 1.5 + 0.3 * torch.randn(n, B, H, D, generator=g)
    vb = va * 0.7 + 0.3 * torch.randn(n, B, H, D, generator=g)
    far = torch.rand(n, B, generator=g) < 0.1
    kb[far] = torch.randn(int(far.sum()), H, D, generator=g) * 3
    return ka, va, kb, vb


def _pages(fmt, seq_lens, spare, seed):
    """Pages of both layers' random K/V and a block table that scatters each request's blocks."""
    B, H, D = fmt.block_size, fmt.k.num_heads, fmt.k.head_size
    return encoded_pages(fmt, seq_lens, spare, seed,
                         lambda g, n, filled: fmt.encode(*_pair_vectors(g, n, B, H, D), filled))


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("HQ", [2, 8])
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("splits", [1, 2])
def test_history_equals_attention_over_the_restored_pages(codec, HQ, block, layer, splits):
    """The layer decode kernel over a pair's pages (``MergedLayer``: the merged directions scaled by
    the layer's norms, the retained tokens left out of their tiles and attended exactly from their
    slots) against attention over ``MergedPairFormat.decode``'s layer: MHA (one row a program) and
    GQA, the context whole or split."""
    H, D = 2, 64
    fmt = MergedPairFormat.from_layer_format(CODECS[codec], 0.6, 0.1, DTYPE, block, H, D)
    seq_lens = [1, 17, block, 3 * block - 5]
    cache, table = _pages(fmt, seq_lens, 3, seed=HQ + block + layer)
    index = fmt.regions.view(cache, "index", torch.int16, (fmt.retained,))
    assert (index >= 0).any(1).sum() >= 4  # tokens are retained: their exact step is exercised
    q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(5)).to(DEVICE, DTYPE)
    scale = D ** -0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode(q, cache.to(DEVICE), MergedLayer(fmt, layer), table.to(DEVICE), lens, scale, max(seq_lens),
                       num_splits=splits)
    for i, L in enumerate(seq_lens):
        k, v = (x.flatten(0, 1)[:L] for x in fmt.decode(cache[table[i, :-(-L // block)].long()], layer))
        logits = torch.einsum("hd,khd->hk", q[i].float().cpu(), k.repeat_interleave(HQ // H, 1)) * scale
        want = torch.einsum("hk,khd->hd", logits.softmax(-1), v.repeat_interleave(HQ // H, 1))
        tol = TOL if codec == "16-bit" else CODES_TOL
        torch.testing.assert_close(out[i].float().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("codec", ["16-bit", "k4v4"])
def test_steps_through_the_kernels_equal_attend_pair(codec, monkeypatch):
    """Steps of both layers of a pair over three requests, prompt chunks (``merged_prompt``: own
    attention, then history rows in groups of 5 continuing from it) and decode rows (``decode_rows``:
    the new token's exact term, then the history from the pages), against ``paged_torch.attend_pair`` on the same pages;
    after each step the second layer's write takes both layers' tokens. The steps cover a first
    chunk, chunks with history across block boundaries, one-token chunks and decodes that open a
    fresh block. On the CPU a torch causal attention stands in for FlashAttention."""
    from test_triton_prompt import torch_own_chunk_attention

    if DEVICE == "cpu":
        monkeypatch.setattr(prompt, "own_chunk_attention", torch_own_chunk_attention)
    H, HQ, D, B = 2, 4, 64, 32
    fmt = MergedPairFormat.from_layer_format(CODECS[codec], 0.6, 0.1, DTYPE, B, H, D)
    g = torch.Generator().manual_seed(11)
    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4).flip(1)
    cache = torch.zeros(12, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    lens = [0, 0, 0]
    steps = ([40, 0, 17], [30, 64, 1], "decode", [1, 5, 14], "decode")
    for step in steps:
        q_lens = [1, 1, 1] if step == "decode" else step
        lens = [L + m for L, m in zip(lens, q_lens)]
        qsl = torch.tensor([0] + q_lens).cumsum(0).tolist()
        new = []
        for layer in (0, 1):
            q = torch.randn(qsl[-1], HQ, D, generator=g).to(DEVICE, DTYPE)
            k, v = (torch.randn(qsl[-1], H, D, generator=g).to(DEVICE, DTYPE) for _ in range(2))
            want = paged_torch.attend_pair(q, cache, fmt, layer, qsl, lens, table.to(DEVICE), D ** -0.5, k, v)
            got = torch.full_like(q, float("nan"))
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
            if step == "decode":
                decode_rows(q, k, v, cache, fmt, layer, table.to(DEVICE), seq_lens - 1, D ** -0.5, max(lens), got)
            else:
                histories = [L - m for L, m in zip(lens, q_lens)]
                rows = token_rows(qsl, histories, table.to(DEVICE), rows_per_group=5)
                merged_prompt.merged_prompt(q, k, v, cache, fmt, layer, rows, D ** -0.5, got)
            tol = TOL if codec == "16-bit" else CODES_TOL
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
            new += [k, v]
        slots = torch.cat([request_slots(table[i], B, L - m + torch.arange(m))
                           for i, (L, m) in enumerate(zip(lens, q_lens))]).to(DEVICE)
        paged_torch.write_pair_tokens(cache, fmt, *new, slots)


def _retained(fmt, pages):
    """Each page's retention slots as a set of (token offset, distance), empty slots left out."""
    R = fmt.retained
    index = fmt.regions.view(pages, "index", torch.int16, (R,)).cpu()
    distance = fmt.regions.view(pages, "distance", torch.float32, (R,)).cpu()
    return [{(int(i), float(d)) for i, d in zip(*row) if i >= 0} for row in zip(index, distance)]


def test_merge_kernel_equals_merge():
    """``pair_merge`` against ``MergedPairFormat.merge`` on tokens whose layers' directions are close,
    far apart, equal (SLERP's linear case), opposite, or zero: the same vectors, norms to float16's
    rounding, directions and distances to float32's (its arccos is a polynomial)."""
    from vllm_kvcompress.triton_kernels.pair_merge import merge_pair

    H, D = 3, 64
    fmt = MergedPairFormat.from_layer_format(CODECS["k4v4"], 0.6, 0.1, DTYPE, 32, H, D)
    g = torch.Generator().manual_seed(2)
    ka, va, kb, vb = (x[0] for x in _pair_vectors(g, 1, 40, H, D))
    kb[:4], vb[:4] = 2.5 * ka[:4], 0.5 * va[:4]    # equal directions
    kb[4:8], vb[4:8] = -ka[4:8], -va[4:8]          # opposite
    ka[8], vb[9] = 0.0, 0.0                        # zero vectors
    tokens = [x.to(DEVICE, DTYPE) for x in (ka, va, kb, vb)]
    got, want = merge_pair(fmt, *tokens), fmt.merge(*tokens)
    assert torch.equal(got[0], want[0].to(fmt.dtype))
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=1e-3, atol=1e-3)
    tol = 1e-5 if DTYPE == torch.float32 else 1e-2  # bfloat16 directions: one rounding step
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("codec", ["16-bit", "k4v4"])
def test_triton_write_equals_append(codec, monkeypatch):
    """Steps of three requests' prompt chunks and decoded tokens, written by ``merged_write`` and by
    the torch reference (``MergedPairFormat.append``: the held and new tokens ranked at once) into
    pages that held another request's tokens before: the same direction codes and norms, the same
    retained tokens with their distances (in whatever slots), the same restored layers. Both merge
    through the merge kernel (checked against the reference's merge above), so that the pages can
    be compared bit for bit."""
    from vllm_kvcompress.triton_kernels.merged_write import write_pair_tokens
    from vllm_kvcompress.triton_kernels.pair_merge import merge_pair


    H, D, B = 2, 64, 32
    fmt = MergedPairFormat.from_layer_format(CODECS[codec], 0.6, 0.1, DTYPE, B, H, D)
    g = torch.Generator().manual_seed(3)
    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4).flip(1)
    stale = fmt.encode(*_pair_vectors(g, 12, B, H, D), torch.full((12,), B)).to(DEVICE)
    want, got = stale.clone(), stale.clone()
    monkeypatch.setattr(MergedPairFormat, "merge", merge_pair)
    lens = [0, 0, 0]
    for q_lens in ([40, 3, 17], [30, 64, 1], [1, 1, 1], [1, 5, 14], [1, 1, 1]):
        slots = torch.cat([request_slots(table[i], B, L + torch.arange(m))
                           for i, (L, m) in enumerate(zip(lens, q_lens))])
        slots = torch.cat([slots, torch.tensor([-1])])  # a padding row
        lens = [L + m for L, m in zip(lens, q_lens)]
        new = [x[0].to(DEVICE, DTYPE) for x in _pair_vectors(g, 1, slots.shape[0], H, D)]
        paged_torch.write_pair_tokens(want, fmt, *new, slots.to(DEVICE))
        write_pair_tokens(got, fmt, *new, slots.to(DEVICE))
        for i, L in enumerate(lens):
            blocks = table[i, :-(-L // B)].long()
            ours, theirs = got.cpu()[blocks], want.cpu()[blocks]
            for a, b in zip(fmt.directions.decode(ours), fmt.directions.decode(theirs)):
                assert torch.equal(a.flatten(0, 1)[:L], b.flatten(0, 1)[:L])
            norms = [fmt.regions.view(p, "norms", torch.float16, (2, 2, H, B)).movedim(-1, 1).flatten(0, 1)[:L]
                     for p in (ours, theirs)]
            assert torch.equal(norms[0].view(torch.int16), norms[1].view(torch.int16))  # signs too
            assert _retained(fmt, ours) == _retained(fmt, theirs)
            for layer in (0, 1):
                for a, b in zip(fmt.decode(ours, layer), fmt.decode(theirs, layer)):
                    assert torch.equal(a.flatten(0, 1)[:L], b.flatten(0, 1)[:L])


def test_warm_ups_write_nothing():
    """The decode and write warm-ups (every kernel a serving step launches, compiled before serving)
    run over a live cache and leave its pages as they were."""
    from vllm_kvcompress.triton_kernels import merged_decode, merged_write

    fmt = MergedPairFormat.from_layer_format(CODECS["k4v4"], 0.6, 0.1, DTYPE, 32, 2, 64)
    cache = torch.randint(0, 256, (3, fmt.page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    cache = cache.to(DEVICE)
    before = cache.clone()
    merged_decode.warm_up(cache, fmt, 4, DTYPE)
    merged_write.warm_up(cache, fmt, DTYPE)
    assert torch.equal(cache, before)


_MERGED_KERNELS = """
import torch
from vllm_kvcompress.config import LayerFormat
from vllm_kvcompress.formats.merged import MergedLayer, MergedPairFormat
from vllm_kvcompress.triton_kernels import decode, merged_write as write, own_token, pair_merge

fmt = MergedPairFormat.from_layer_format(LayerFormat(**%s), 0.6, 0.05, torch.bfloat16, 128, 8, 128)
compile_for_h100(write._retain_kernel, {"slot_ptr": "*i64", "n": "i32", "distance_ptr": "*fp32", "norms_ptr": "*fp16",
                                        "x_ptr": "*bf16", "cache_ptr": "*u8"}, write.retain_variant(fmt).constants)
merge_runtime = {name: "*bf16" for name in ("ka_ptr", "va_ptr", "kb_ptr", "vb_ptr", "x_ptr", "merged_ptr")}
merge_runtime |= dict(norms_ptr="*fp16", distance_ptr="*fp32", ka_stride="i32", va_stride="i32", kb_stride="i32",
                      vb_stride="i32", t="fp32")
compile_for_h100(pair_merge._merge_kernel, merge_runtime, dict(H=8, HP=8, D=128))
compile_for_h100(own_token._own_token_kernel, dict(q_ptr="*bf16", key_ptr="*bf16", value_ptr="*bf16",
                                              out_ptr="*bf16", lse_ptr="*fp32", scale="fp32",
                                              **{name: "i32" for name in own_token._own_token_kernel.arg_names
                                                 if name.endswith("_stride")}),
                 own_token._own_token_variant(128, 4).constants)
layer_runtime = dict(q_ptr="*bf16", cache_ptr="*u8", half_ptr="*fp16", block_table_ptr="*i32", seq_lens_ptr="*i32",
                     group_rows_ptr="*i32", group_start_ptr="*i32", out_ptr="*bf16", part_ptr="*fp32",
                     lse_ptr="*fp32", sm_scale="fp32")
layer_runtime |= {name: "i32" for name in decode._decode_kernel.arg_names if name not in layer_runtime
                  and name.islower()}
for layer, group, split, rows in ((0, 1, False, None), (1, 4, True, 16)):
    compile_for_h100(decode._decode_kernel, layer_runtime,
                     decode.kernel_constants(MergedLayer(fmt, layer), group, split, 128, rows, True, rows is None, True))
"""


@pytest.mark.parametrize("codec", ["16-bit", "k4v4"])
def test_the_merged_kernels_compile_for_the_gpu(codec):
    from sm90 import compiles_for_h100

    compiles_for_h100(_MERGED_KERNELS % CODECS[codec].model_dump(include={"k_bits", "v_bits"}))
