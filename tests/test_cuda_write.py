"""The CUDA cache-write kernel (csrc/) writes the same bytes as the torch reference. The kernel
tests need a GPU, and nvcc or the prebuilt kernels; what the kernel covers is the registry's
(tests/test_kernel_registry.py)."""

import pytest
import torch

from vllm_kvcompress import cuda_jit, cuda_write, paged_torch
from vllm_kvcompress.config import LayerFormat
from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.formats import page_layout
from vllm_kvcompress.kernels import registry
from c_structs import c_struct_fields, stub_launches

COVERED = [LayerFormat(k_bits=4, v_bits=4), LayerFormat(k_bits=2, v_bits=2), LayerFormat(k_bits=8, v_bits=8),
           LayerFormat(k_bits=4, v_bits=8, k_axis="token", v_axis="channel"), LayerFormat(k_bits=2, k_only=True)]
needs_cuda_kernels = pytest.mark.skipif(registry.why_no_cuda_kernels_here() is not None,
                                        reason="needs a CUDA GPU, and nvcc or the prebuilt kernels")


def _format(layer_format, dtype=torch.float32, block=16, heads=2, head_size=64):
    return KVPageFormat.from_layer_format(layer_format, dtype, block, heads, head_size)


def test_launch_arguments_mirror_the_kernels_structs():
    assert cuda_write._TensorArgs._fields_ == c_struct_fields("write_kernel.cu", "Tensor")
    assert cuda_write._WriteArgs._fields_ == c_struct_fields("write_kernel.cu", "WriteArgs",
                                                             {"Tensor": cuda_write._TensorArgs})


@pytest.mark.parametrize("layer_format", [LayerFormat(k_bits=4, v_bits=4), LayerFormat(k_bits=4, v_bits=8)],
                         ids=["one launch", "K and V apart"])
def test_a_steps_layers_share_one_plan_and_pass_their_own_pointers(monkeypatch, layer_format):
    """The slots are planned once a step; each layer's call passes its own K, V and cache (K and V of
    different widths in a launch each)."""
    calls = []
    plans = stub_launches(monkeypatch, cuda_write, lambda args: calls.append(
        (args.a.src, args.a.src_stride, args.a.codes, args.b.src, args.b.src_stride, args.b.codes, args.cache,
         args.slots, args.num_tokens, args.bits)))
    fmt = _format(layer_format)
    slots = torch.tensor([3, 40, 41])
    layers = [(torch.randn(3, 6, 64)[:, i:i + 2], torch.randn(3, 2, 64),
               torch.zeros(8, fmt.page_bytes, dtype=torch.uint8)) for i in range(3)]
    for k, v, cache in layers:
        cuda_write.write_tokens(cache, fmt, k, v, slots)
    assert len(plans) == 1
    lay = page_layout(fmt)
    launches = [(k, v, k.data_ptr(), v.data_ptr()) for k, v, _ in layers]
    if lay.k.bits == lay.v.bits:
        expected = [(kp, 6 * 64, lay.k.codes, vp, 2 * 64, lay.v.codes, c.data_ptr(), slots.data_ptr(), 3, 4)
                    for (_, _, kp, vp), (_, _, c) in zip(launches, layers)]
    else:
        expected = [x for (_, _, kp, vp), (_, _, c) in zip(launches, layers)
                    for x in ((kp, 6 * 64, lay.k.codes, kp, 6 * 64, lay.k.codes, c.data_ptr(), slots.data_ptr(), 3, 4),
                              (vp, 2 * 64, lay.v.codes, vp, 2 * 64, lay.v.codes, c.data_ptr(), slots.data_ptr(), 3, 8))]
    assert calls == expected


def test_a_changed_header_rebuilds_the_kernels(tmp_path, monkeypatch):
    """torch's build cache keys on the sources' contents and the flags, not on included headers: the
    headers' digest is in the flags, so editing csrc/*.cuh builds again rather than loading a stale build."""
    import ctypes

    import torch.utils.cpp_extension
    for header in cuda_jit.CSRC.glob("*.cuh"):
        (tmp_path / header.name).write_bytes(header.read_bytes())
    assert any(tmp_path.glob("*.cuh"))
    monkeypatch.setattr(cuda_jit, "CSRC", tmp_path)
    flags = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: flags.append(kw["extra_cuda_cflags"]))
    monkeypatch.setattr(ctypes, "CDLL", lambda path: None)
    cuda_jit.load("kernel", "kernel.cu", "KVCOMPRESS_WRITE")
    header = next(tmp_path.glob("*.cuh"))
    header.write_bytes(header.read_bytes() + b"\n// edited\n")
    cuda_jit.load("kernel", "kernel.cu", "KVCOMPRESS_WRITE")
    assert flags[0] != flags[1]


@pytest.mark.parametrize("age_s, removed", [(cuda_jit.STALE_LOCK_S + 60, True), (30, False)])
def test_a_stale_build_lock_is_removed(tmp_path, monkeypatch, caplog, age_s, removed):
    """A process killed in the middle of a build leaves torch's lock file in the build directory,
    and every later build would wait on it forever (an engine hanging at startup): a lock older than
    STALE_LOCK_S is removed before building; a younger one (another process building now) is kept,
    and the wait is logged with the lock's path."""
    import ctypes
    import os
    import time

    import torch.utils.cpp_extension
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "kernel" / "lock"
    lock.parent.mkdir()
    lock.touch()
    os.utime(lock, (time.time() - age_s,) * 2)
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: seen.append(lock.exists()))
    monkeypatch.setattr(ctypes, "CDLL", lambda path: None)
    with caplog.at_level("INFO", logger="vllm.kvcompress"):
        cuda_jit.load("kernel", "kernel.cu", "KVCOMPRESS_WRITE")
    assert seen == [not removed]
    assert str(lock) in caplog.text and ("removing" if removed else "waiting") in caplog.text


def _assert_pages_hold_reference_values(fmt, steps, new_kv):
    """Each step's slots written by the torch reference and by the kernel (``new_kv(n)``: the step's
    K and V on the CPU); after each step the pages decode to the same values. Values, not bytes: for
    rows past a block's last token, which nothing reads, the reference also writes per-token
    statistics."""
    ref = torch.zeros(8, fmt.page_bytes, dtype=torch.uint8)
    ours = ref.cuda()
    for slots in steps:
        k, v = new_kv(len(slots))
        paged_torch.write_tokens(ref, fmt, k, v, slots)
        cuda_write.write_tokens(ours, fmt, k.cuda(), v.cuda(), slots.cuda())
        for got, want in zip(fmt.decode(ours.cpu()), fmt.decode(ref)):
            assert (got is None and want is None) or torch.equal(got, want)


@needs_cuda_kernels
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer_format", COVERED, ids=lambda f: f.describe())
def test_prefill_and_decode_match_reference(layer_format, dtype, head_size):
    """A prefill batch (a full block, a partial block, one across two blocks, a skipped slot), then
    decode steps, then chunks appended to stored rows (one crossing into a new block)."""
    B, H, D = 16, 2, head_size
    fmt = _format(layer_format, dtype, B, H, D)
    gen = torch.Generator().manual_seed(1)
    steps = [torch.cat([torch.arange(3 * B, 4 * B), torch.arange(5 * B, 5 * B + 5), torch.tensor([-1]),
                        torch.arange(B, 2 * B + 9)])]
    steps += [torch.tensor([5 * B + 5 + s, 2 * B + 9 + s]) for s in range(6)]
    steps += [torch.cat([torch.arange(5 * B + 11, 5 * B + 14), torch.tensor([2 * B + 15, 6 * B, 6 * B + 1])])]
    _assert_pages_hold_reference_values(fmt, steps, lambda n: (
        (torch.randn(n, H, D, generator=gen) * 2 + 0.5).to(dtype), (torch.randn(n, H, D, generator=gen) - 0.3).to(dtype)))


@needs_cuda_kernels
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_decode_into_new_blocks_matches_reference(bits, head_size):
    """Decode steps whose token is the first of a block (a lane a chunk of channels, each on its
    one value's grid), beside tokens appended to stored rows: two requests crossing into their next
    block at different steps, then appending to it."""
    B, H = 128, 4
    fmt = _format(LayerFormat(k_bits=bits, v_bits=bits), torch.bfloat16, B, H, head_size)
    gen = torch.Generator().manual_seed(bits + head_size)
    steps = [torch.cat([torch.arange(0, B - 1), torch.arange(2 * B, 3 * B - 3)])]
    steps += [torch.tensor([B - 1 + s, 3 * B - 3 + s]) for s in range(6)]
    _assert_pages_hold_reference_values(fmt, steps, lambda n: (
        (torch.randn(n, H, head_size, generator=gen) * 2 - 0.5).bfloat16(),
        torch.randn(n, H, head_size, generator=gen).bfloat16()))


@needs_cuda_kernels
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_long_prompts_and_chunks_match_reference(bits):
    """128-token blocks: a 300-token prompt and a 70-token one (blocks with more new tokens than the
    32 warps a block's encode is dealt over), then chunks of 40 and 3 tokens appended to their
    partly filled blocks, then a decode step."""
    B, H, D = 128, 4, 128
    fmt = _format(LayerFormat(k_bits=bits, v_bits=bits), torch.bfloat16, B, H, D)
    gen = torch.Generator().manual_seed(bits)
    steps = [torch.cat([torch.arange(0, 300), torch.arange(4 * B, 4 * B + 70)]),
             torch.cat([torch.arange(300, 340), torch.arange(4 * B + 70, 4 * B + 73)]),
             torch.tensor([340, 4 * B + 73])]
    _assert_pages_hold_reference_values(fmt, steps, lambda n: (
        (torch.randn(n, H, D, generator=gen) * 1.5).bfloat16(), torch.randn(n, H, D, generator=gen).bfloat16()))


@needs_cuda_kernels
@pytest.mark.parametrize("bits,fills,head_size,B", [(4, (90, 100), 128, 128), (2, (3, 1), 64, 128),
                                                (8, (60, 100), 128, 128), (4, (30, 40), 128, 64)])
def test_decode_appends_match_reference_bytes(bits, fills, head_size, B):
    """Decoding into blocks of B tokens, K and V as strided views of one fused tensor: identical
    pages after each of twenty steps, whether a step keeps every earlier code or re-encodes
    widened channels."""
    H = 4
    fmt = _format(LayerFormat(k_bits=bits, v_bits=bits), torch.bfloat16, B, H, head_size)
    gen = torch.Generator().manual_seed(bits)
    ref = torch.zeros(4, fmt.page_bytes, dtype=torch.uint8)
    prefill = torch.cat([torch.arange(B, B + fills[0]), torch.arange(3 * B, 3 * B + fills[1])])
    paged_torch.write_tokens(ref, fmt, torch.randn(len(prefill), H, head_size, generator=gen).bfloat16(),
                             torch.randn(len(prefill), H, head_size, generator=gen).bfloat16(), prefill)
    ours = ref.cuda()
    for step in range(20):
        slots = torch.tensor([B + fills[0] + step, 3 * B + fills[1] + step])
        fused = torch.randn(2, 3 * H, head_size, generator=gen).bfloat16()  # q, k, v of a fused projection
        paged_torch.write_tokens(ref, fmt, fused[:, H:2 * H], fused[:, 2 * H:], slots)
        fused = fused.cuda()
        cuda_write.write_tokens(ours, fmt, fused[:, H:2 * H], fused[:, 2 * H:], slots.cuda())
        assert torch.equal(ours.cpu(), ref), f"step {step}"
