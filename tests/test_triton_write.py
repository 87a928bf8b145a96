"""The Triton cache-write kernel writes the same bytes as the torch reference."""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from paged_cases import PACKED_FORMATS, format_id  # noqa: E402

from vllm_kvcompress import paged_torch  # noqa: E402
from vllm_kvcompress.config import LayerFormat  # noqa: E402
from vllm_kvcompress.formats import KVPageFormat  # noqa: E402
from vllm_kvcompress.triton_kernels.write import write_tokens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = PACKED_FORMATS + [
    LayerFormat(k_bits=16, v_bits=4), LayerFormat(), LayerFormat(k_bits=4, v_bits=8, k_axis="token", v_axis="channel"),
    LayerFormat(k_bits=3, v_bits=2, v_axis="channel", v_channel_scaling=True), LayerFormat(k_only=True),
    LayerFormat(k_bits=8, k_only=True), LayerFormat(k_bits=3, v_bits=2, outlier_tokens=1),
    LayerFormat(k_bits=2, v_bits=2, outlier_tokens=2), LayerFormat(k_bits=2, v_bits=2, outlier_tokens=1, k_clip=True)]


@pytest.mark.parametrize("dealt", [False, True], ids=["shares", "dealt"])
@pytest.mark.parametrize("layer_format", FORMATS, ids=format_id)
def test_write_matches_reference_bytes(layer_format, dealt):
    """A prefill batch (three requests: a full block, partial blocks, one across two blocks), two
    decode steps, then a chunk of several tokens appended to two partly filled blocks: identical
    pages, whether a block's chunks go to shares of each token's programs or are dealt out over the
    programs of its last tokens (as for a prefill's many tokens)."""
    B = 16
    _steps_match_reference(layer_format, dealt, B, [
        torch.cat([torch.arange(3 * B, 3 * B + 16), torch.arange(5 * B, 5 * B + 5), torch.arange(1 * B, 1 * B + 9)]),
        torch.tensor([5 * B + 5, 1 * B + 9]),
        torch.tensor([5 * B + 6, -1, 1 * B + 10]),
        torch.cat([torch.arange(5 * B + 7, 5 * B + 13), torch.arange(1 * B + 11, 1 * B + 14)]),
    ])


@pytest.mark.parametrize("dealt", [False, True], ids=["shares", "dealt"])
@pytest.mark.parametrize("bits", [2, 4])
def test_write_matches_reference_bytes_in_token_groups(bits, dealt):
    """64-token blocks, whose 2- and 4-bit V codes lie in two groups of 32 tokens (docs/formats.md):
    a full block, a prefill ending in its second group, decode steps, and chunks crossing from the
    first group into the second."""
    B = 64
    _steps_match_reference(LayerFormat(k_bits=bits, v_bits=bits), dealt, B, [
        torch.cat([torch.arange(3 * B, 4 * B), torch.arange(5 * B, 5 * B + 40), torch.arange(1 * B, 1 * B + 9)]),
        torch.tensor([5 * B + 40, 1 * B + 9]),
        torch.cat([torch.arange(5 * B + 41, 5 * B + 50), torch.arange(1 * B + 10, 1 * B + 36)]),
    ])


@pytest.mark.parametrize("dealt", [False, True], ids=["shares", "dealt"])
@pytest.mark.parametrize("clip", [False, True], ids=["minmax", "clipped"])
def test_outlier_choice_matches_reference_over_stale_pages(dealt, clip):
    """Pages that held another request's tokens (random bytes, stale outlier offsets among them):
    a prompt's blocks choose their outliers, sinks at their first tokens among them; a block begun
    by a decode's single token keeps none; both write paths agree on every page they touch, K's
    grids narrowed (``k_clip``) or not. K and V come as views into one fused QKV row, as the
    attention layer hands them over."""
    B = 16
    layer_format = LayerFormat(k_bits=2 if clip else 3, v_bits=2, outlier_tokens=1, k_clip=clip)
    _steps_match_reference(layer_format, dealt, B, [
        torch.cat([torch.arange(3 * B, 3 * B + 16), torch.arange(5 * B, 5 * B + 5), torch.arange(1 * B, 1 * B + 1)]),
        torch.tensor([5 * B + 5, 1 * B + 1]),
        torch.tensor([6 * B, 7 * B]),
        torch.cat([torch.arange(6 * B + 1, 6 * B + 9), torch.arange(7 * B + 1, 7 * B + 3)]),
    ], stale=True, sinks=True, fused=True)


def _steps_match_reference(layer_format, dealt, B, steps, stale=False, sinks=False, fused=False):
    """Writes ``steps`` (each a step's slots) with the kernel and with the reference: identical
    pages decoded wherever a step wrote. ``stale``: the pages start as random bytes; ``sinks``: a
    token written at a block's offset 0 has a K far from the others'; ``fused``: the kernel reads K
    and V as views into one [N, 3H, D] tensor."""
    H, D = 2, 64
    fmt = KVPageFormat.from_layer_format(layer_format, torch.float32, B, H, D)
    gen = torch.Generator().manual_seed(0)
    ref = torch.zeros(8, fmt.page_bytes, dtype=torch.uint8)
    if stale:
        ref = torch.randint(0, 256, ref.shape, dtype=torch.uint8, generator=gen)
    ours = ref.clone().to(DEVICE)
    for slots in steps:
        k = torch.randn(len(slots), H, D, generator=gen) * 2 + 0.5
        v = torch.randn(len(slots), H, D, generator=gen) - 0.3
        if sinks:
            k[slots % B == 0] += 10
        paged_torch.write_tokens(ref, fmt, k, v, slots)
        key, value = k.to(DEVICE), v.to(DEVICE)
        if fused:
            qkv = torch.cat([key, value, key], dim=1)
            key, value = qkv[:, :H], qkv[:, H:2 * H]
        write_tokens(ours, fmt, key, value, slots.to(DEVICE), dealt=dealt)
    used = [1, 3, 5, 6, 7]
    if fmt.outliers:
        assert torch.equal(fmt.outlier_index(ours.cpu()[used]), fmt.outlier_index(ref[used]))
        if sinks:  # the prompt's full block keeps its sink; the blocks begun by a decode keep none
            assert fmt.outlier_index(ref[[3]])[0, :, 0].tolist() == [0, 0]
            assert (fmt.outlier_index(ref[[1, 6, 7]]) == -1).all()
    kr, vr = fmt.decode(ref)
    ko, vo = fmt.decode(ours.cpu())
    rows = torch.zeros(ref.shape[0], B, dtype=torch.bool)
    if stale:  # rows no step wrote hold the other request's bytes, which only the reference re-encodes
        written = torch.cat(steps)
        rows.view(-1)[written[written >= 0]] = True
    else:
        rows[used] = True
    torch.testing.assert_close(ko[rows], kr[rows], rtol=0, atol=1e-6)
    if vr is not None:
        torch.testing.assert_close(vo[rows], vr[rows], rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits,fills,chunk_channels,append_units,dealt", [
    (4, (90, 100), 32, 8, False), (3, (90, 100), 32, 8, False), (4, (2, 5), 8, 8, False), (2, (3, 1), 8, 8, False),
    (4, (90, 100), 32, 8, True), (2, (3, 1), 8, 2, True), (4, (2, 5), 4, 8, True)])
def test_decode_appends_match_reference_bytes(bits, fills, chunk_channels, append_units, dealt):
    """Decoding into 128-token blocks: twenty steps of two requests, identical pages after each step.
    Well filled, most new tokens fit their channels' stored grids and some widen one, and both
    outcomes occur (a step either leaves every earlier code and the statistics in place or rewrites
    some of them). Nearly empty, a token widens more channels than one re-encode takes (a chunk in
    shares, ``append_units`` units where dealt). Dealt (a decode row in a prefill's step), the
    block's last token does the append."""
    B, H, D = 128, 2, 64
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=bits, v_bits=bits), torch.float32, B, H, D)
    gen = torch.Generator().manual_seed(bits)
    ref = torch.zeros(4, fmt.page_bytes, dtype=torch.uint8)
    prefill = torch.cat([torch.arange(B, B + fills[0]), torch.arange(3 * B, 3 * B + fills[1])])
    paged_torch.write_tokens(ref, fmt, torch.randn(len(prefill), H, D, generator=gen),
                             torch.randn(len(prefill), H, D, generator=gen), prefill)
    ours = ref.clone().to(DEVICE)
    k_codes = fmt.k.regions.offsets["codes"][1]  # head-major [H, B, row bytes]
    k_stats = slice(fmt.k.regions.offsets["scale"][0], fmt.k.nbytes)
    k_scale = slice(fmt.k.regions.offsets["scale"][0], fmt.k.regions.offsets["scale"][0] + H * D * 2)
    earlier_kept = earlier_rewritten = most_widened = 0
    for step in range(20):
        slots = torch.tensor([B + fills[0] + step, 3 * B + fills[1] + step])
        k, v = torch.randn(2, H, D, generator=gen), torch.randn(2, H, D, generator=gen)
        before = ref.clone()
        paged_torch.write_tokens(ref, fmt, k, v, slots)
        write_tokens(ours, fmt, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), chunk_channels=chunk_channels,
                     append_units=append_units, dealt=dealt)
        assert torch.equal(ours.cpu(), ref), f"step {step}"
        for blk, n in ((1, fills[0] + step), (3, fills[1] + step)):
            earlier = slice(0, n * k_codes // (H * B))  # the earlier tokens' rows of each head
            same = (torch.equal(before[blk, :k_codes].view(H, -1)[:, earlier], ref[blk, :k_codes].view(H, -1)[:, earlier])
                    and torch.equal(before[blk, k_stats], ref[blk, k_stats]))
            earlier_kept += same
            earlier_rewritten += not same
            widened = before[blk, k_scale].view(torch.float16).view(H, D) != ref[blk, k_scale].view(torch.float16).view(H, D)
            most_widened = max(most_widened, int(widened.sum(1).max()))
    if min(fills) > 32:
        assert earlier_kept > 0 and earlier_rewritten > 0
    else:
        assert most_widened > (append_units * 8 // bits if dealt else chunk_channels)


def _record_launches(monkeypatch) -> list:
    """The write kernel's launches from here on, as (variant, grid), each still launched."""
    from vllm_kvcompress.triton_kernels import write
    launches = []
    real = write.launch
    monkeypatch.setattr(write, "launch", lambda variant, grid, args: launches.append((variant, grid))
                        or real(variant, grid, args))
    return launches


def test_k_and_v_are_written_in_one_launch(monkeypatch):
    """A step's write is one launch for K and V (V's own launch cost a 144-request decode step
    15.6 us on an H200), and it still writes both tensors as the reference does."""
    from vllm_kvcompress.triton_kernels import write
    B, H, D = 16, 2, 64
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), torch.float32, B, H, D)
    slots = torch.arange(B, B + 5)
    k, v = torch.randn(5, H, D), torch.randn(5, H, D) - 0.3
    ref = torch.zeros(3, fmt.page_bytes, dtype=torch.uint8)
    paged_torch.write_tokens(ref, fmt, k, v, slots)
    launches = _record_launches(monkeypatch)
    ours = torch.zeros_like(ref).to(DEVICE)
    write.write_tokens(ours, fmt, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    assert len(launches) == 1
    (kr, vr), (ko, vo) = fmt.decode(ref), fmt.decode(ours.cpu())
    torch.testing.assert_close(ko[1, :5], kr[1, :5], rtol=0, atol=1e-6)  # the written tokens'
    torch.testing.assert_close(vo[1, :5], vr[1, :5], rtol=0, atol=1e-6)


def test_a_large_step_deals_each_blocks_chunks_over_its_last_tokens(monkeypatch):
    """Past DEALT_PROGRAMS (tokens x heads), a step launches one program a (token, head), and the
    block's chunks of channels go to the programs of its last tokens, each program a chunk; a
    smaller step keeps SPREAD shares a token. Both write what the reference writes."""
    from vllm_kvcompress.triton_kernels import write
    B, H, D = 16, 2, 64
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), torch.float32, B, H, D)
    launches = _record_launches(monkeypatch)
    monkeypatch.setattr(write, "DEALT_PROGRAMS", 19 * H)
    ref = torch.zeros(6, fmt.page_bytes, dtype=torch.uint8)
    ours = ref.clone().to(DEVICE)
    for slots in (torch.arange(B, B + 19), torch.arange(3 * B, 3 * B + 20)):  # 19 tokens: shares; 20: dealt
        k, v = torch.randn(len(slots), H, D), torch.randn(len(slots), H, D)
        paged_torch.write_tokens(ref, fmt, k, v, slots)
        write.write_tokens(ours, fmt, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    (kr, vr), (ko, vo) = fmt.decode(ref), fmt.decode(ours.cpu())
    torch.testing.assert_close(ko[1:5], kr[1:5], rtol=0, atol=1e-6)
    torch.testing.assert_close(vo[1:5], vr[1:5], rtol=0, atol=1e-6)
    (shared, shared_grid), (dealt, dealt_grid) = launches
    assert shared_grid == (19, H, write.SPREAD) and shared.constants["K_DEAL"] == 1
    assert dealt_grid == (20, H, 1) and dealt.constants["K_DEAL"] == D // write.CHUNK_CHANNELS


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_per_channel_write_keeps_to_its_register_cap(bits):
    """The compiled write holds at most REGISTER_CAP registers a thread (89 uncapped at 4/4 on an H200), so
    more of a decode step's programs share an SM; in both of its variants (shares and dealt)."""
    from vllm_kvcompress.triton_kernels import launch, write
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=bits, v_bits=bits), torch.bfloat16, 128, 4, 128)
    cache = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device="cuda")
    k, v = (torch.randn(3, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for dealt in (False, True):
        write.write_tokens(cache, fmt, k, v, torch.tensor([0, 1, 130], device="cuda"), dealt=dealt)
        variant, _ = write._write_variant(fmt, write.CHUNK_CHANNELS, write.SPREAD, write.APPEND_UNITS, None, dealt)
        kept = [compiled for (v_, _), (compiled, _) in launch._compiled.items() if v_ is variant]
        assert kept and all(0 < c.n_regs <= write.REGISTER_CAP for c in kept)


_WRITE_KERNEL = """
import torch
from vllm_kvcompress.config import LayerFormat
from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.triton_kernels import write

fmt = KVPageFormat.from_layer_format(LayerFormat(**%(fields)s), torch.bfloat16, 128, 8, 128)
runtime = dict(k_ptr="*bf16", v_ptr="*bf16", slot_ptr="*i64", cache_ptr="*u8", num_tokens="i32", page_bytes="i32",
               k_stride="i32", v_stride="i32")
for dealt in (False, True):
    variant, _ = write._write_variant(fmt, write.CHUNK_CHANNELS, write.SPREAD, write.APPEND_UNITS, None, dealt)
    compile_for_h100(write._write_kernel, runtime, variant.constants)
"""


@pytest.mark.parametrize("fields", [dict(k_bits=4, v_bits=4), dict(k_bits=3, v_bits=2, outlier_tokens=1),
                                    dict(k_bits=2, v_bits=2, outlier_tokens=1, k_clip=True)],
                         ids=lambda fields: format_id(LayerFormat(**fields)))
def test_the_write_kernel_compiles_for_the_gpu(fields):
    """The write kernel, in its shares and its dealt variant, passes the sm_90 compiler's front end
    (the CPU suite runs it in the interpreter, which lets through what the compiler refuses)."""
    from sm90 import compiles_for_h100

    compiles_for_h100(_WRITE_KERNEL % dict(fields=fields))
