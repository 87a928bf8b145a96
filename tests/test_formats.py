"""The quant page format against its arithmetic (no vLLM needed)."""

import pytest
import torch

from reference_quant import _grid, _quant, fake_quant
from vllm_kvcompress.config import LayerFormat
from vllm_kvcompress.formats import KVPageFormat, MinMaxCodec
from vllm_kvcompress.formats.packing import pack, packed_row_bytes, unpack
from vllm_kvcompress import paged_torch

torch.manual_seed(0)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [64, 128, 22])
def test_pack_round_trip(bits, n):
    if bits != 8 and n % 8:
        pytest.skip("packing needs whole bytes of every plane")
    codes = torch.randint(0, 1 << bits, (3, 5, n))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == packed_row_bytes(n, bits)
    assert torch.equal(unpack(packed, bits, n), codes.int())


def test_three_bit_plane_layout():
    """docs/formats.md: a 3-bit row of D codes is D / 4 bytes of their low two bits (code i at bits
    2 * (i % 4) of byte i // 4), then D / 8 bytes of their high bits (code i at bit i % 8 of byte
    D / 4 + i // 8)."""
    codes = torch.randint(0, 8, (16,))
    expected = [0] * 6
    for i, c in enumerate(codes.tolist()):
        expected[i // 4] |= (c & 3) << (2 * (i % 4))
        expected[4 + i // 8] |= (c >> 2) << (i % 8)
    assert pack(codes, 3).tolist() == expected
    assert packed_row_bytes(64, 3) == 24 and packed_row_bytes(128, 3) == 48


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_min_max_grid_on_the_gpu_equals_the_cpu(bits):
    """A grid's scale is the IEEE quotient on either device (as in the kernels): torch on a GPU would
    multiply by the reciprocal of a plain number, and a million spans would show it."""
    from vllm_kvcompress.formats.codecs import min_max_grid
    lo, hi = torch.randn(2, 1_000_000).sort(0).values
    top = (1 << bits) - 1
    cpu = min_max_grid(lo, hi, top)
    gpu = min_max_grid(lo.cuda(), hi.cuda(), top)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


def _codec(bits, axis, scaling=False, B=128, H=4, D=64):
    return MinMaxCodec(bits, axis, scaling, B, H, D)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_codec_equals_formula(bits, axis):
    B, H, D = 128, 4, 64
    x = torch.randn(3, B, H, D) * 2 + 0.5
    valid = torch.tensor([B, 77, 1])
    codec = _codec(bits, axis, B=B, H=H, D=D)
    y = codec.decode(codec.encode(x, valid))
    for n in range(3):
        ref = fake_quant(x[n, :valid[n]], bits, axis, block=B)
        torch.testing.assert_close(y[n, :valid[n]], ref, rtol=0, atol=1e-5)


def _page_and_reference_rows(bits, axis, B=16, H=3, D=64):
    """A full page of random values, and its codes packed row by row ([B, H, bytes]) by the
    reference's formula; the codes region starts the page."""
    x = torch.randn(1, B, H, D)
    page = _codec(bits, axis, B=B, H=H, D=D).encode(x, torch.tensor([B]))
    zero, step = _grid(x[0], 0 if axis == "channel" else 2, bits)
    return page[0], pack(_quant(x[0], zero, step, bits).long(), bits)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("B", [64, 48])
def test_token_statistics_codes_are_stored_unit_major_in_token_groups(bits, B):
    """docs/formats.md: with statistics per token, byte u of token t's row of head h (R bytes) is
    byte ((h * B / G + t // G) * R + u) * G + t % G of the codes region: groups of G = 32 tokens at
    2, 3 and 4 bits where 32 divides the block, else the whole block."""
    group = 32 if bits in (2, 3, 4) and B % 32 == 0 else B
    page, rows = _page_and_reference_rows(bits, "token", B=B)
    B, H, R = rows.shape
    t, h, u = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(R), indexing="ij")
    where = ((h * (B // group) + t // group) * R + u) * group + t % group
    assert torch.equal(page[where.reshape(-1)], rows.reshape(-1))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_channel_statistics_codes_are_stored_head_major(bits):
    """docs/formats.md: with statistics per channel, token t's packed row of head h is row h * B + t
    of the codes region."""
    page, rows = _page_and_reference_rows(bits, "channel")
    B, H, _ = rows.shape
    assert torch.equal(page[:rows.numel()].reshape(H, B, -1), rows.transpose(0, 1))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_round_trip_error_within_half_step(bits, axis):
    """|x - x^| <= (max - min) / levels / 2 per element (plus fp16 rounding of scale and zero)."""
    B, H, D = 128, 2, 64
    x = torch.randn(2, B, H, D)
    codec = _codec(bits, axis, B=B, H=H, D=D)
    y = codec.decode(codec.encode(x, torch.tensor([B, B])))
    dims = 1 if axis == "channel" else 3
    span = x.amax(dims, keepdim=True) - x.amin(dims, keepdim=True)
    bound = span / ((1 << bits) - 1.0) / 2 * (1 + 2e-3) + 2e-3 * x.abs().amax()
    assert ((y - x).abs() <= bound).all()


def test_channel_scaling_restores_channels():
    """ZipCache's channel-separable V: an outlier channel no longer swamps the others."""
    B, H, D = 128, 2, 64
    x = torch.randn(1, B, H, D)
    x[..., 5] *= 50  # outlier channel
    valid = torch.tensor([B])
    plain = _codec(2, "token", False, B, H, D)
    scaled = _codec(2, "token", True, B, H, D)
    err_plain = (plain.decode(plain.encode(x, valid)) - x)[..., 6:].abs().mean()
    err_scaled = (scaled.decode(scaled.encode(x, valid)) - x)[..., 6:].abs().mean()
    assert err_scaled < 0.5 * err_plain


@pytest.mark.parametrize("head_size", [64, 128])
def test_page_capacity_ratios(head_size):
    """Scales included, 16-bit pages hold >= 3.5x fewer tokens than 4/4 and >= 6x fewer than 2/2."""
    def ratio(bits):
        f = KVPageFormat.from_layer_format(LayerFormat(k_bits=bits, v_bits=bits), torch.bfloat16, 128, 8, head_size)
        return f.dense_page_bytes() / f.page_bytes
    assert ratio(4) >= 3.5
    assert ratio(2) >= 6.0
    assert ratio(8) >= 1.85


def test_write_in_pieces_reads_back():
    """Appending tokens one by one re-encodes the block; each token stays within the quantization bound."""
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=8, v_bits=8), torch.float32, 16, 2, 64)
    cache = torch.zeros(4, fmt.page_bytes, dtype=torch.uint8)
    k, v = torch.randn(20, 2, 64), torch.randn(20, 2, 64)
    slots = torch.cat([torch.arange(32, 48), torch.arange(16, 20)])  # block 2 then block 1
    paged_torch.write_tokens(cache, fmt, k[:10], v[:10], slots[:10])
    for i in range(10, 20):
        paged_torch.write_tokens(cache, fmt, k[i:i + 1], v[i:i + 1], slots[i:i + 1])
    kd, vd = fmt.decode(cache)
    got_k = torch.cat([kd[2], kd[1, :4]])
    got_v = torch.cat([vd[2], vd[1, :4]])
    assert (got_k - k).abs().max() < 0.05 and (got_v - v).abs().max() < 0.05


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_append_keeps_a_channel_grid_until_a_value_falls_off_it(bits):
    """Per-channel K statistics under appends: a prefill piece, then single tokens, then a short chunk,
    written through the reference write path, equal an independent statement of the append rule, and
    both kinds of append (grid kept, channel re-encoded) occur."""
    from reference_quant import appended_channel_quant

    B, H, D = 32, 2, 64
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=bits, v_bits=4), torch.float32, B, H, D)
    cache = torch.zeros(3, fmt.page_bytes, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(bits)
    k, v = torch.randn(30, H, D, generator=gen), torch.randn(30, H, D, generator=gen)
    sizes = [6] + [1] * 20 + [4]
    start, pieces = 0, []
    for n in sizes:
        paged_torch.write_tokens(cache, fmt, k[start:start + n], v[start:start + n], torch.arange(B + start, B + start + n))
        pieces.append(k[start:start + n])
        start += n
    expected, kept, reencoded = appended_channel_quant(pieces, bits)
    got, _ = fmt.decode(cache)
    torch.testing.assert_close(got[1, :start], expected, rtol=0, atol=1e-6)
    assert kept > 0 and reencoded > 0


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_widened_grid_reaches_past_the_new_value(bits):
    """A token that falls off a K channel's grid widens it to span the stored grid and the token,
    and further out by 1/8 of that span on the side the token passed (docs/formats.md), so that a
    channel drifting that way fits the next tokens; the other side stays where it was."""
    B, H, D = 32, 2, 64
    top = (1 << bits) - 1
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=bits, v_bits=4), torch.float32, B, H, D)
    codec = fmt.k
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(1, B, H, D, generator=gen) * torch.linspace(0.2, 3, D)
    pages = codec.encode(x, torch.tensor([4]))
    below = above = 0
    for n in range(4, B):
        rows = codec.decode(pages)
        rows[0, n] = x[0, n]
        appended = codec.encode(rows, torch.tensor([n + 1]), pages, torch.tensor([n]))
        old_zero, old_scale, zero, scale = (codec._stats_from_page(p, s)[0, 0] for p in (pages, appended)
                                            for s in ("zero", "scale"))
        new = x[0, n]
        changed = (zero != old_zero) | (scale != old_scale)
        old_top = old_zero + old_scale * top
        lo, hi = torch.minimum(new, old_zero), torch.maximum(new, old_top)
        span = hi - lo
        lo, hi = torch.where(new < old_zero, lo - span / 8, lo), torch.where(new > old_top, hi + span / 8, hi)
        want_zero = lo.half().float()
        want_scale = ((hi - want_zero) / top).clamp_min(1e-6).half().float()
        assert torch.equal(zero[changed], want_zero[changed]) and torch.equal(scale[changed], want_scale[changed])
        below += int((changed & (new < old_zero)).sum())
        above += int((changed & (new > old_top)).sum())
        pages = appended
    assert below > 0 and above > 0


def test_uncompressed_write_is_exact():
    fmt = KVPageFormat.from_layer_format(LayerFormat(), torch.float32, 16, 2, 64)
    cache = torch.zeros(3, fmt.page_bytes, dtype=torch.uint8)
    k, v = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    paged_torch.write_tokens(cache, fmt, k, v, torch.tensor([16, 17, 18, -1, 19]))
    kd, vd = fmt.decode(cache)
    assert torch.equal(kd[1, :3], k[:3]) and torch.equal(kd[1, 3], k[4]) and torch.equal(vd[1, 3], v[4])


def test_paged_attention_equals_dense_attention():
    """Mixed batch (a prefill chunk and decodes) over scattered blocks == causal softmax attention
    over the fake-quantized K/V, but for the chunk's own tokens, which it sees exactly (a decode
    reads its own token back from the pages)."""
    torch.manual_seed(1)
    B, Hkv, Hq, D = 16, 2, 4, 64
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), torch.float32, B, Hkv, D)
    cache = torch.zeros(12, fmt.page_bytes, dtype=torch.uint8)
    seq_lens, q_lens = [37, 5, 16], [7, 1, 1]
    tables = torch.tensor([[7, 2, 9, 0], [4, 0, 0, 0], [11, 0, 0, 0]])
    keys, values = [], []
    for i, L in enumerate(seq_lens):
        k, v = torch.randn(L, Hkv, D), torch.randn(L, Hkv, D)
        slots = tables[i, torch.arange(L) // B] * B + torch.arange(L) % B
        paged_torch.write_tokens(cache, fmt, k, v, slots)
        keys.append(k), values.append(v)
    q = torch.randn(sum(q_lens), Hq, D)
    qsl = [0, 7, 8, 9]
    new_k = torch.cat([k[L - m:] for k, L, m in zip(keys, seq_lens, q_lens)])
    new_v = torch.cat([v[L - m:] for v, L, m in zip(values, seq_lens, q_lens)])
    out = paged_torch.attend(q, cache, fmt, qsl, seq_lens, tables, scale=D ** -0.5, key=new_k, value=new_v)
    for i, L in enumerate(seq_lens):
        kq = fake_quant(keys[i], 4, "channel", B)
        vq = fake_quant(values[i], 4, "token", B)
        if q_lens[i] > 1:
            kq[L - q_lens[i]:], vq[L - q_lens[i]:] = keys[i][L - q_lens[i]:], values[i][L - q_lens[i]:]
        for j in range(q_lens[i]):
            pos = L - q_lens[i] + j
            for h in range(Hq):
                kv_h = h // (Hq // Hkv)
                s = (kq[:pos + 1, kv_h] @ q[qsl[i] + j, h]) * D ** -0.5
                ref = torch.softmax(s, 0) @ vq[:pos + 1, kv_h]
                torch.testing.assert_close(out[qsl[i] + j, h], ref, rtol=1e-4, atol=1e-4)
