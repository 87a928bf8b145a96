"""Outlier tokens (``outlier_tokens``): a block's most deviant tokens kept apart on their own grids, outside its statistics."""

import pytest
import torch

from reference_quant import OUTLIER_K_BITS, OUTLIER_V_BITS, fake_quant, fake_quant_with_outliers, row_quant
from vllm_kvcompress import paged_torch
from vllm_kvcompress.config import KVCompressionConfigError, LayerFormat, load_config
from vllm_kvcompress.formats import KVPageFormat


def _sinky(seq: int, H: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V with an attention-sink-like first token (K far from the others in many channels)
    and one more stray token per 32."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(seq, H, D, generator=g), torch.randn(seq, H, D, generator=g)
    k[0] += 12 * torch.randn(H, D, generator=g)
    k[5::32] += 6 * torch.randn(k[5::32].shape, generator=g)
    return k, v


def _format(k_bits, v_bits, count, block, H, D, dtype=torch.float32, clip=False):
    layer = LayerFormat(k_bits=k_bits, v_bits=v_bits, outlier_tokens=count, k_clip=clip)
    return KVPageFormat.from_layer_format(layer, dtype, block, H, D)


@pytest.mark.parametrize("k_bits,v_bits,count,clip", [(3, 2, 1, False), (2, 2, 2, False), (4, 4, 1, False),
                                                      (2, 2, 1, True), (3, 2, 2, True)])
def test_blocks_written_whole_equal_the_reference(k_bits, v_bits, count, clip):
    B, H, D, seq = 32, 3, 64, 80
    k, v = _sinky(seq, H, D, seed=k_bits * 10 + count)
    fmt = _format(k_bits, v_bits, count, B, H, D, clip=clip)
    blocks = -(-seq // B)
    pad = blocks * B - seq
    kb = torch.cat([k, k.new_zeros(pad, H, D)]).reshape(blocks, B, H, D)
    vb = torch.cat([v, v.new_zeros(pad, H, D)]).reshape(blocks, B, H, D)
    num_valid = torch.tensor([min(B, seq - i * B) for i in range(blocks)])
    pages = fmt.encode(kb, vb, num_valid)
    got_k, got_v = (x.flatten(0, 1)[:seq] for x in fmt.decode(pages))
    ratios = tuple(1 - r / 16 for r in range(9)) if clip else None  # docs/formats.md's ratios
    want_k, want_v, chosen = fake_quant_with_outliers(k, v, k_bits, v_bits, B, count, ratios)
    index = fmt.outlier_index(pages)
    assert [[sorted(index[n, h].tolist()) for h in range(H)] for n in range(blocks)] == chosen
    assert all(0 in chosen[0][h] for h in range(H))  # the sink is kept by every head
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-5)
    # and the feature shows: the plain format's K error is far larger, the unclipped one's larger
    plain = (fake_quant(k, k_bits, "channel", B) - k).abs().mean()
    assert (got_k - k).abs().mean() < 0.6 * plain
    if clip:  # grids narrowed where that lowers the error the rule weighs (ratio 1 is among its choices)
        unclipped = fake_quant_with_outliers(k, v, k_bits, v_bits, B, count)[0]
        assert _weighted_error(got_k, k, chosen, B) < _weighted_error(unclipped, k, chosen, B)


def _weighted_error(coded, k, chosen, B):
    """Sum over blocks, heads and channels of each non-outlier value's squared error times its squared
    distance from the middle of its channel's range over the block's non-outlier tokens."""
    total = 0.0
    for n, kept in enumerate(chosen):
        for h, offsets in enumerate(kept):
            rows = [t for t in range(n * B, min(k.shape[0], (n + 1) * B)) if t - n * B not in offsets]
            x = k[rows, h]
            mid = (x.amax(0) + x.amin(0)) / 2
            total += (((coded[rows, h] - x) * (x - mid)) ** 2).sum().item()
    return total


def test_capacity_counts_the_slots():
    """Head size 128, 8 KV heads, 128-token pages: 3/2 bits hold 5.82x a 16-bit cache's tokens, less
    with an outlier a block: each head's offset (int16), 8-bit K and 4-bit V codes and their float16
    zeros and scales, the page rounded up to 128 slots of whole bfloat16 elements."""
    def ratio(count):
        fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=3, v_bits=2, outlier_tokens=count), torch.bfloat16,
                                             128, 8, 128)
        return fmt.dense_page_bytes() / fmt.page_bytes
    assert ratio(0) == pytest.approx(5.818, abs=1e-3)
    page = 8 * 11264 + 16 + 8 * 128 + 8 * 64 + 8 * 2 * 2 * 2  # codes and statistics, offsets, outlier rows
    assert ratio(1) == pytest.approx(8 * 65536 / (128 * 2 * -(-page // 256)), abs=1e-6)


@pytest.mark.parametrize("heads,outlier_bytes", [(3, 16 + 192 + 96 + 32), (2, 16 + 128 + 64 + 16)])
def test_the_2_bit_outlier_preset_holds_6_5x_at_head_size_64(heads, outlier_bytes):
    """quant-k2v2-o1-clip at SmolLM2's (3 KV heads) and Qwen2.5-Coder's (2) shapes: 2-bit K and V codes,
    K's zero and scale per channel, V's per token, and the outlier's offset, 8-bit K and 4-bit V
    codes and four float16 statistics a head (regions rounded up to 16 bytes) hold 6.5x bfloat16."""
    fmt = KVPageFormat.from_layer_format(load_config("quant-k2v2-o1-clip").default, torch.bfloat16, 128, heads, 64)
    regions = heads * (2 * 128 * 64 * 2 // 8 + 64 * 2 * 2 + 128 * 2 * 2) + outlier_bytes
    assert fmt.page_bytes == 128 * 2 * -(-regions // 256)  # 128 slots of whole bfloat16 elements
    assert fmt.dense_page_bytes() / fmt.page_bytes >= 6.5


def test_appends_keep_the_first_writes_outliers():
    """Through the torch write path: a prompt's first block in two writes keeps the outliers of the
    first; a block begun by a decode's single token keeps none; reading back gives the outliers'
    rows as coded on their own grids."""
    B, H, D = 16, 2, 64
    fmt = _format(3, 2, 1, B, H, D)
    k, v = _sinky(B + 2, H, D, seed=3)
    cache = torch.zeros(4, fmt.page_bytes, dtype=torch.uint8)
    slots = torch.arange(B + 2) + B  # block 1, then block 2
    paged_torch.write_tokens(cache, fmt, k[:6], v[:6], slots[:6])
    first = fmt.outlier_index(cache[1:2])
    assert first[0, :, 0].tolist() == [0, 0]
    paged_torch.write_tokens(cache, fmt, k[6:B], v[6:B], slots[6:B])
    paged_torch.write_tokens(cache, fmt, k[B:B + 1], v[B:B + 1], slots[B:B + 1])
    paged_torch.write_tokens(cache, fmt, k[B + 1:], v[B + 1:], slots[B + 1:])
    assert torch.equal(fmt.outlier_index(cache[1:2]), first)
    assert (fmt.outlier_index(cache[2:3]) == -1).all()
    got_k, got_v = fmt.decode(cache[1:2])
    torch.testing.assert_close(got_k[0, 0], row_quant(k[0], OUTLIER_K_BITS), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_v[0, 0], row_quant(v[0], OUTLIER_V_BITS), rtol=0, atol=1e-6)
    # the others' grid is theirs: the sink's K lies far off it
    assert (got_k[0, 1:] - k[1:B]).abs().max() < 0.5 * (k[0] - k[1:B].mean(0)).abs().max()


@pytest.mark.parametrize("fields,message", [
    ({"k_bits": 16, "v_bits": 4, "outlier_tokens": 1}, "needs quantized K"),
    ({"k_bits": 4, "k_only": True, "outlier_tokens": 1}, "cannot be combined with k_only"),
    ({"k_bits": 4, "v_bits": 4, "rpc_fraction": 0.1, "rpc_tokens": 8, "outlier_tokens": 1}, "recent window"),
    ({"k_bits": 4, "v_bits": 4, "outlier_tokens": 9}, "outlier_tokens"),
    ({"k_bits": 2, "v_bits": 2, "k_clip": True}, "k_clip needs outlier_tokens >= 1"),
    ({"k_bits": 2, "v_bits": 2, "k_axis": "token", "outlier_tokens": 1, "k_clip": True}, "k_axis = 'token'"),
    ({"k_bits": 16, "v_bits": 4, "k_clip": True}, "k_bits = 16"),
])
def test_bad_outlier_settings_are_refused(fields, message):
    with pytest.raises(KVCompressionConfigError, match=message):
        load_config({"default": fields})


def test_outliers_with_merged_layers_are_refused():
    from vllm_kvcompress.engine_config import layer_page_format
    cfg = load_config({"default": {"k_bits": 4, "v_bits": 4, "outlier_tokens": 1}, "merge": {"start_layer": 2}})
    with pytest.raises(KVCompressionConfigError, match="cannot be combined with 'merge'"):
        layer_page_format(cfg, 2, 4, torch.bfloat16, 16, 2, 64)


_OUTLIER_KERNELS = """
import torch
from vllm_kvcompress.config import LayerFormat
from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.triton_kernels import decode, outlier_select

fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=%(k)d, v_bits=%(v)d, outlier_tokens=%(count)d),
                                     torch.bfloat16, 128, 8, 128)
runtime = dict(q_ptr="*bf16", cache_ptr="*u8", half_ptr="*fp16", block_table_ptr="*i32", seq_lens_ptr="*i32",
               group_rows_ptr="*i32", group_start_ptr="*i32", out_ptr="*bf16", part_ptr="*fp32", lse_ptr="*fp32",
               sm_scale="fp32")
runtime |= {name: "i32" for name in decode._decode_kernel.arg_names if name not in runtime and name.islower()}
for group, split, rows in ((1, False, None), (4, True, None), (4, False, 16)):
    compile_for_h100(decode._decode_kernel, runtime,
                     decode.kernel_constants(fmt, group, split, 128, rows, True, rows is None, rows is not None))
select = dict(k_ptr="*bf16", v_ptr="*bf16", slot_ptr="*i64", cache_ptr="*u8", num_tokens="i32", page_bytes="i32",
              k_stride="i32", v_stride="i32")
compile_for_h100(outlier_select._select_kernel, select, outlier_select._variant(fmt).constants)
"""


@pytest.mark.parametrize("k_bits,v_bits,count", [(3, 2, 1), (4, 4, 2)])
def test_the_outlier_kernels_compile_for_the_gpu(k_bits, v_bits, count):
    """The decode kernel's outlier path (MHA one row, GQA split, prompt groups) and the choice kernel
    pass the sm_90 compiler's front end (the CPU suite runs them in the interpreter)."""
    from sm90 import compiles_for_h100

    compiles_for_h100(_OUTLIER_KERNELS % dict(k=k_bits, v=v_bits, count=count))


@pytest.mark.engine
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU engine in float32; CUDA serves bfloat16 and float16")
def test_engine_prompt_logprobs_equal_the_reference(mha):
    """Through vLLM, prompts in chunks of 128 tokens (one block, written whole): prompt logprobs equal
    a Hugging Face model whose attention reads earlier chunks through ``fake_quant_with_outliers``
    (bounds as in test_engine's test_prompt_logprobs_equal_torch_reference), and differ from the same
    bits without outliers."""
    from engine_utils import assert_equal_to_reference, engine, prompt_logprobs, prose, reference_prompt_logprobs

    prompts = [prose(300, 31), prose(140, 32)]
    config = {"default": {"k_bits": 3, "v_bits": 2, "outlier_tokens": 1}}
    with engine(mha, config, enable_chunked_prefill=True, max_num_batched_tokens=128, max_num_seqs=4) as llm:
        got = [prompt_logprobs(llm, [p])[0] for p in prompts]
    want = reference_prompt_logprobs(mha, prompts, 3, 2, block=128, chunk=128, outliers=1)
    plain = reference_prompt_logprobs(mha, prompts, 3, 2, block=128, chunk=128)
    assert_equal_to_reference(got, want, plain, effect=5e-2)  # the outliers are visible
