"""ZipCache's CUDA decode (``csrc/salient_decode_kernel.cu``, MHA) against attention over the decoded pages.

Runs where a CUDA GPU and nvcc (or the prebuilt kernels) are present; the struct check runs everywhere.
"""

import pytest
import torch

from vllm_kvcompress import cuda_salient_decode
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.kernels import registry
from c_structs import c_struct_fields
from paged_cases import assert_replays_equal_eager, salient_pages


def test_launch_arguments_mirror_the_kernels_struct():
    assert cuda_salient_decode._SalientDecodeArgs._fields_ == c_struct_fields("salient_decode_kernel.cu",
                                                                               "SalientDecodeArgs")


gpu = pytest.mark.skipif(registry.why_no_cuda_decode_here() is not None,
                         reason=f"CUDA kernels: {registry.why_no_cuda_decode_here()}")


def _rows(fmt, history, seed):
    """Decode rows' queries and new K, V [N, H, D] (MHA)."""
    g = torch.Generator().manual_seed(seed)
    n, H, D = len(history), fmt.k.num_heads, fmt.k.head_size
    return [torch.randn(n, H, D, generator=g) for _ in range(3)]


def _want(fmt, cache, table, history, q, k_new, v_new, scale):
    """Each row's attention over its decoded history and its new token, and the log-sum-exp [H, N]."""
    outs, lses = [], []
    for i, L in enumerate(history):
        k, v = (x.flatten(0, 1)[:L] for x in fmt.decode(cache[table[i, :-(-L // fmt.block_size)].long()]))
        k, v = torch.cat([k, k_new[i:i + 1]]), torch.cat([v, v_new[i:i + 1]])
        logits = torch.einsum("hd,khd->hk", q[i], k) * scale
        outs.append(torch.einsum("hk,khd->hd", logits.softmax(-1), v))
        lses.append(logits.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses, 1)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("block", [64, 128])
def test_decode_rows_equal_attention_over_the_decoded_pages(block, splits, dtype):
    """Rows over their history (refined tokens' low bits through the slot map, the others at the middle
    of their sub-levels; a row of no history, rows ending inside a slice and on a page's end) and
    their own new token, in one split, three (the merge kernel continuing the own token), or the
    launch's own count: the output and the merged log-sum-exp equal attention over the decoded pages."""
    H, D = 3, 128
    fmt = SalientTokensFormat.create(0.6, dtype, block, H, D)
    history = [0, 17, block, 3 * block - 5, 70, 1000, 2 * block + 64]
    cache, table = salient_pages(fmt, history, 3, seed=block + (splits or 0))
    q, k_new, v_new = _rows(fmt, history, 5)
    scale = D ** -0.5
    dev = [x.cuda().to(dtype) for x in (q, k_new, v_new)]
    out = torch.empty_like(dev[0])
    lse = cuda_salient_decode.decode_rows(*dev, cache.cuda(), fmt, table.cuda(),
                                          torch.tensor(history, dtype=torch.int32, device="cuda"), scale,
                                          max(history), out, num_splits=splits)
    want, want_lse = _want(fmt, cache, table, history, *(x.to(dtype).float() for x in (q, k_new, v_new)), scale)
    # float16 factors in the products (the query scaled by K's steps, the probabilities by V's), as
    # the 4-bit CUDA decode's tests allow
    torch.testing.assert_close(out.float().cpu(), want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=2e-2, atol=2e-2)


@gpu
def test_rows_in_given_order_match_the_triton_kernel():
    """Rows taken longest first (the backend's order) give what the Triton kernel gives the same rows,
    within the float16 rounding both take in their products."""
    from vllm_kvcompress.triton_kernels.decode import longest_first
    from vllm_kvcompress.triton_kernels.salient_decode import decode_rows as triton_decode_rows

    H, D, B = 4, 128, 128
    fmt = SalientTokensFormat.create(0.6, torch.bfloat16, B, H, D)
    history = [900, 33, 400, 129, 1, 640]
    cache, table = salient_pages(fmt, history, 2, seed=11)
    q, k_new, v_new = (x.cuda().bfloat16() for x in _rows(fmt, history, 6))
    lens = torch.tensor(history, dtype=torch.int32, device="cuda")
    args = (q, k_new, v_new, cache.cuda(), fmt, table.cuda(), lens, D ** -0.5, max(history))
    out, ref = torch.empty_like(q), torch.empty_like(q)
    lse = cuda_salient_decode.decode_rows(*args, out, row_order=longest_first(lens))
    ref_lse = triton_decode_rows(*args, ref)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-3, atol=2e-3)


@gpu
def test_decode_and_write_replayed_in_a_cuda_graph():
    """Decode steps as vLLM's full CUDA graphs run them (the CUDA decode, then the decode write): three
    rows and a padding row captured once, replayed for three steps whose tokens advance, equal to
    the same steps run eagerly: outputs and pages bit for bit."""
    from vllm_kvcompress import cuda_salient_write
    from vllm_kvcompress.config import SalientSpec

    H, D, B = 2, 128, 64
    fmt = SalientTokensFormat.create(0.6, torch.bfloat16, B, H, D)
    spec = SalientSpec(ratio=0.6, recompress_interval=100)
    history = [98, 40, 300]
    cache, table = salient_pages(fmt, history + [0], 6, seed=7)
    table = table.cuda()
    steps = []
    for s in range(3):
        q, k, v = (x.cuda().bfloat16() for x in _rows(fmt, history + [0], 20 + s))
        steps.append([q, k, v, torch.tensor([L + 1 + s for L in history] + [0], dtype=torch.int32, device="cuda")])
    inputs = [torch.empty_like(x) for x in steps[0]]
    out = torch.empty_like(inputs[0])

    def step(pages):
        q, k, v, lens = inputs
        lse = cuda_salient_decode.decode_rows(q, k, v, pages, fmt, table, (lens - 1).clamp(min=0), D ** -0.5, 2048,
                                              out)
        cuda_salient_write.write_decoded(q, k, v, pages, fmt, spec, table, lens, lse.t(), D ** -0.5)

    assert_replays_equal_eager(step, inputs, steps, out, cache)
