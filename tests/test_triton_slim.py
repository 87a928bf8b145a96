"""The Triton decode for K-only pages against attention with V built in full: V = RoPE^-1(K) W_KV.

Runs on the CPU in Triton's interpreter (small shapes) and on the GPU where present.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from vllm_kvcompress import paged_torch  # noqa: E402
from vllm_kvcompress.config import LayerFormat  # noqa: E402
from vllm_kvcompress.formats import KVPageFormat  # noqa: E402
from vllm_kvcompress.slim import Rotary, SlimLayer  # noqa: E402
from vllm_kvcompress.triton_kernels.slim_decode import slim_decode  # noqa: E402
from vllm_kvcompress.kernels import registry  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rope_table(max_pos: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[max_pos, dim] = [cos | sin] of pos * theta^(-2i/dim): the RoPE of the Llama paper."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def unrope_reference(k: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each position back by its angle, written as the inverse 2x2 rotation on (x_i, x_{i+D/2})."""
    half = k.shape[-1] // 2
    cos, sin = table[:k.shape[0], :half, None].transpose(1, 2), table[:k.shape[0], half:, None].transpose(1, 2)
    x1, x2 = k[..., :half], k[..., half:]
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


def slim_layer(heads, head_size, dtype, max_pos, gen):
    """A SlimLayer with a random W_KV and the Llama RoPE table; and W_KV itself."""
    table = rope_table(max_pos, head_size)
    size = heads * head_size
    w_kv = (torch.randn(size, size, generator=gen) / size ** 0.5).to(dtype)
    return SlimLayer.from_w_kv(w_kv, heads, Rotary(table, head_size, True)), w_kv


def values_reference(k, slim, w_kv):
    """V of keys k [L, H, D] after RoPE at positions 0..L-1: RoPE^-1(K) W_KV in float32."""
    return (unrope_reference(k.float(), slim.rotary.cos_sin).flatten(1) @ w_kv.float()).view(k.shape)


def paged_keys(seq_lens, heads, head_size, block, dtype, gen, k_bits=16):
    """K-only pages holding random keys for each request, at shuffled blocks: (fmt, cache, block
    table, each request's keys [L, H, D] as the pages give them back)."""
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_only=True, k_bits=k_bits), dtype, block, heads, head_size)
    max_blocks = max(-(-L // block) for L in seq_lens)
    num_blocks = sum(-(-L // block) for L in seq_lens) + 3
    cache = torch.zeros(num_blocks, fmt.page_bytes, dtype=torch.uint8)
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    keys, used = [], 0
    for i, L in enumerate(seq_lens):
        nb = -(-L // block)
        bt[i, :nb] = perm[used:used + nb]
        used += nb
        k = (torch.randn(L, heads, head_size, generator=gen) + 0.2).to(dtype)
        slots = bt[i, torch.arange(L) // block].long() * block + torch.arange(L) % block
        paged_torch.write_tokens(cache, fmt, k, k, slots)
        keys.append(fmt.decode(cache[bt[i, :nb].long()])[0].flatten(0, 1)[:L].to(dtype))  # 8 bits: as rounded
    return fmt, cache, bt, keys


def decode_case(seq_lens, heads, head_size, block, dtype, seed=0, k_bits=16):
    """Inputs of one decode step on the device, and the reference: attention with V built in full."""
    gen = torch.Generator().manual_seed(seed)
    fmt, cache, bt, keys = paged_keys(seq_lens, heads, head_size, block, dtype, gen, k_bits)
    slim, w_kv = slim_layer(heads, head_size, dtype, max(seq_lens) + 1, gen)
    ctx = registry.LayerContext(registry.Device("cuda", (9, 0)), dtype, heads, rotary=slim.rotary)
    assert registry.plan(fmt, ctx, registry.KernelPolicy()).decode.name == "triton-slim"
    q = torch.randn(len(seq_lens), heads, head_size, generator=gen).to(dtype)
    want = []
    for i, k in enumerate(keys):
        probs = (torch.einsum("hd,lhd->hl", q[i].float(), k.float()) * head_size ** -0.5).softmax(-1)
        want.append(torch.einsum("hl,lhd->hd", probs, values_reference(k, slim, w_kv)))
    slim_dev = SlimLayer(slim.w_heads.to(DEVICE), Rotary(slim.rotary.cos_sin.to(DEVICE), head_size, True))
    args = (q.to(DEVICE), cache.to(DEVICE), fmt, bt.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32,
                                                                           device=DEVICE))
    return args, slim_dev, torch.stack(want)


def run(seq_lens, heads, head_size, block, dtype, seed=0, k_bits=16):
    (q, cache, fmt, bt, lens), slim, want = decode_case(seq_lens, heads, head_size, block, dtype, seed, k_bits)
    got = slim_decode(q, cache, fmt, bt, lens, head_size ** -0.5, max(seq_lens), slim)
    return got.float().cpu(), want


@pytest.mark.parametrize("k_bits", [16, 8])
@pytest.mark.parametrize("seq_lens", [[1, 17, 40], [64, 3]])
def test_slim_decode_equals_full_v_attention_small(seq_lens, k_bits):
    """Against attention with V built in full from the keys as the pages hold them (8 bits: the
    torch codec's decoding of the codes)."""
    got, want = run(seq_lens, heads=2, head_size=32, block=16, dtype=torch.float16, k_bits=k_bits)
    torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k_bits", [16, 8])
@pytest.mark.parametrize("heads, head_size, block", [(32, 128, 128), (16, 64, 16), (8, 256, 64)])
def test_slim_decode_equals_full_v_attention_gpu(heads, head_size, block, k_bits):
    got, want = run([1, 200, 1000, 4097], heads, head_size, block, torch.bfloat16, seed=heads, k_bits=k_bits)
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_slim_decode_replayed_from_a_cuda_graph_gpu():
    """Captured for the longest context (as the backend does under capture), then replayed on
    shorter and longer contexts of the same rows: the graph's results are eager's and the reference's."""
    heads, d, block = 32, 128, 128
    (q, cache, fmt, bt, lens), slim, want = decode_case([700, 1, 2048, 129], heads, d, block, torch.bfloat16, seed=5)
    static_lens = torch.tensor([1, 1, 1, 1], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        slim_decode(q, cache, fmt, bt, static_lens, d ** -0.5, 2048, slim, out=out)  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            slim_decode(q, cache, fmt, bt, static_lens, d ** -0.5, 2048, slim, out=out)
    static_lens.copy_(lens)
    graph.replay()
    torch.cuda.synchronize()
    eager = slim_decode(q, cache, fmt, bt, lens, d ** -0.5, 2048, slim)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(out.float().cpu(), want, rtol=3e-2, atol=3e-2)


def prompt_case(histories, q_lens, heads, head_size, block, dtype, seed, k_bits=16):
    """Prompt chunks after ``histories`` tokens in K-only pages; the chunks' own K are random and
    their V = RoPE^-1(K) W_KV, as a model with that W_KV computes it. Returns the slim prompt's
    arguments and the reference: causal attention over history and chunk with V built in full."""
    from vllm_kvcompress.token_rows import token_rows

    gen = torch.Generator().manual_seed(seed)
    lens = [h + m for h, m in zip(histories, q_lens)]
    fmt, cache, bt, keys = paged_keys(lens, heads, head_size, block, dtype, gen, k_bits)  # read: the history
    slim, w_kv = slim_layer(heads, head_size, dtype, max(lens) + 1, gen)
    q = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(dtype)
    new_k = torch.cat([k[h:] for k, h in zip(keys, histories)])
    new_v = torch.cat([values_reference(k, slim, w_kv)[h:] for k, h in zip(keys, histories)]).to(dtype)
    starts = [0]
    for m in q_lens:
        starts.append(starts[-1] + m)
    want = []
    for i, (k, h, m) in enumerate(zip(keys, histories, q_lens)):
        qi = q[starts[i]:starts[i + 1]].float().transpose(0, 1)  # [H, m, D]
        scores = qi @ k.float().permute(1, 2, 0) * head_size ** -0.5  # [H, m, h + m]
        causal = torch.arange(h + m)[None, :] > (h + torch.arange(m))[:, None]
        v = torch.cat([values_reference(k, slim, w_kv)[:h], new_v[starts[i]:starts[i + 1]].float()])
        want.append((scores.masked_fill(causal, float("-inf")).softmax(-1) @ v.transpose(0, 1)).transpose(0, 1))
    slim_dev = SlimLayer(slim.w_heads.to(DEVICE), Rotary(slim.rotary.cos_sin.to(DEVICE), head_size, True))
    bt_dev = bt.to(DEVICE)
    rows = token_rows(starts, histories, bt_dev)
    args = (q.to(DEVICE), new_k.to(DEVICE), new_v.to(DEVICE), cache.to(DEVICE), fmt, rows, starts, lens, bt_dev,
            head_size ** -0.5, slim_dev)
    return args, torch.cat(want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k_bits", [16, 8])
@pytest.mark.parametrize("histories, q_lens", [([0, 0, 0], [5, 130, 1]), ([0, 300, 0, 4097], [17, 64, 1, 200])])
def test_slim_prompt_equals_full_v_attention_gpu(histories, q_lens, k_bits):
    """Chunks without history (FlashAttention alone) and with (V rebuilt from the pages' K)."""
    from vllm_kvcompress.triton_kernels.slim_prompt import slim_prompt

    args, want = prompt_case(histories, q_lens, 32, 128, 128, torch.bfloat16, seed=len(q_lens), k_bits=k_bits)
    out = torch.empty_like(args[0])
    slim_prompt(*args, out)
    torch.testing.assert_close(out.float().cpu(), want, rtol=3e-2, atol=3e-2)


def test_slim_values_are_unrotated_keys_times_w_kv():
    gen = torch.Generator().manual_seed(3)
    slim, w_kv = slim_layer(4, 32, torch.float32, 50, gen)
    k = torch.randn(50, 4, 32, generator=gen)
    got = slim.values(k, torch.arange(50), torch.float32)
    torch.testing.assert_close(got, values_reference(k, slim, w_kv), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k_bits", [16, 8])
def test_history_kv_in_pieces_equals_the_whole(k_bits):
    """A prompt chunk's history K and rebuilt V, taken a few pages at a time (bounded memory), equal
    the pages' keys and RoPE^-1(K) W_KV over the whole history at once."""
    from vllm_kvcompress.triton_kernels.slim_prompt import history_kv

    gen = torch.Generator().manual_seed(7)
    fmt, cache, bt, (keys,) = paged_keys([150], 2, 32, 16, torch.float32, gen, k_bits)
    slim, w_kv = slim_layer(2, 32, torch.float32, 151, gen)
    for history, piece in ((150, 32), (131, 48), (17, 2048)):
        k, v = history_kv(cache, fmt, bt[0], history, slim, torch.float32, piece=piece)
        torch.testing.assert_close(k, keys[:history], rtol=0, atol=0)
        torch.testing.assert_close(v, values_reference(keys, slim, w_kv)[:history], rtol=1e-4, atol=1e-4)
