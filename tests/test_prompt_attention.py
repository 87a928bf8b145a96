"""Prompt chunks through FlashAttention over their stored K and V, against the torch reference's
causal attention over the pages (``paged_torch.attend``), alone and beside chunks with history."""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from paged_cases import PACKED_FORMATS, fill_pages, format_id, request_slots  # noqa: E402

from vllm_kvcompress import paged_torch, prompt_attention  # noqa: E402
from vllm_kvcompress.config import LayerFormat  # noqa: E402
from vllm_kvcompress.formats import KVPageFormat  # noqa: E402

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FORMATS = PACKED_FORMATS


def _queries(qsl: list[int], hq: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Queries as a view into a fused QKV output (row-strided), as the engine hands them over."""
    qkv = torch.randn(qsl[-1], (hq + 2) * d, generator=torch.Generator().manual_seed(seed)).to(dtype).cuda()
    return qkv[:, :hq * d].view(qsl[-1], hq, d)


def _slots(table: torch.Tensor, block: int, seq_lens: list[int], q_lens: list[int]) -> torch.Tensor:
    """The slots of each request's last ``q_lens`` tokens (the chunk's own)."""
    return torch.cat([request_slots(table[i], block, torch.arange(L - m, L))
                      for i, (L, m) in enumerate(zip(seq_lens, q_lens))])


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("block, head_size", [(16, 64), (128, 128), (128, 256)])
@pytest.mark.parametrize("layer_format", FORMATS, ids=format_id)
def test_first_chunks_equal_reference(layer_format, block, head_size, heads, dtype):
    """Four prompts with no history (lengths not multiples of the block; one of a single token) in
    one launch: each token's attention over its prompt's tokens as stored."""
    hq, h = heads
    fmt = KVPageFormat.from_layer_format(layer_format, dtype, block, h, head_size)
    seq_lens = [2 * block + 7, 1, block, 37]
    qsl = [0]
    for n in seq_lens:
        qsl.append(qsl[-1] + n)
    cache, table = fill_pages(fmt, seq_lens, 2, seed=block + head_size)
    q = _queries(qsl, hq, head_size, dtype, seed=3)
    ref = paged_torch.attend(q.float().cpu(), cache, fmt, qsl, seq_lens, table, head_size ** -0.5)
    out = torch.empty_like(q)
    chunks = prompt_attention.FirstChunks(torch.tensor(qsl, dtype=torch.int32, device="cuda"), max(seq_lens))
    prompt_attention.attend_first_chunks(q, cache.cuda(), fmt, _slots(table, block, seq_lens, seq_lens).cuda(), chunks,
                                         head_size ** -0.5, out)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)


@GPU
@pytest.mark.parametrize("bits", [4, 2])
def test_first_chunks_beside_chunks_with_history(bits):
    """As the backend runs a mixed step's prompts: FlashAttention over every chunk as if it had no
    history, then the decode kernel's rows over the chunks with history only (``token_rows`` with
    ``selected``), which overwrite those chunks' rows. Every row equals the reference."""
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels.decode import paged_decode, rows_per_program
    B, H, HQ, D = 16, 2, 4, 64
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=bits, v_bits=bits), torch.bfloat16, B, H, D)
    seq_lens, q_lens = [40, 9, 70, 33], [25, 9, 3, 33]  # a chunk after 15 tokens, a prompt, 3 after 67, a prompt
    history = [L > m for L, m in zip(seq_lens, q_lens)]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    cache, table = fill_pages(fmt, seq_lens, 3, seed=bits)
    q = _queries(qsl, HQ, D, torch.bfloat16, seed=5)
    ref = paged_torch.attend(q.float().cpu(), cache, fmt, qsl, seq_lens, table, D ** -0.5)
    cache, out = cache.cuda(), torch.empty_like(q)
    chunks = prompt_attention.FirstChunks(torch.tensor(qsl, dtype=torch.int32, device="cuda"), max(q_lens))
    prompt_attention.attend_first_chunks(q, cache, fmt, _slots(table, B, seq_lens, q_lens).cuda(), chunks, D ** -0.5,
                                         out)
    rows = token_rows(qsl, torch.tensor(seq_lens, device="cuda"), table.cuda(), 70, rows_per_program(HQ // H),
                      selected=history)
    paged_decode(q, cache, fmt, rows.block_table, rows.seq_lens, D ** -0.5, rows.max_seq_len, out=out,
                 groups=rows.groups)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)


def test_modes_checked():
    """A value of KVCOMPRESS_PROMPTS that names no path is refused, as is ``flash`` where
    FlashAttention cannot run."""
    with pytest.raises(ValueError, match="KVCOMPRESS_PROMPTS='auto': allowed are 'triton' .*and 'flash'"):
        prompt_attention.choose("auto", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="KVCOMPRESS_PROMPTS=flash: FlashAttention cannot be used: model dtype"):
        prompt_attention.choose("flash", torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="KVCOMPRESS_PROMPTS=flash: FlashAttention cannot be used: the cache is on"):
        prompt_attention.choose("flash", torch.bfloat16, torch.device("cpu"))
    assert prompt_attention.choose("triton", torch.bfloat16, torch.device("cuda")) is False


def test_rows_are_the_default_and_flash_is_chosen_by_name(monkeypatch):
    """Where FlashAttention could run, prompts still go to the decode kernel's rows unless
    KVCOMPRESS_PROMPTS=flash (the rows measured faster end to end)."""
    from vllm_kvcompress.backend import uses_flash_prompts

    monkeypatch.setattr(prompt_attention, "_why_not_flash", lambda dtype, device: None)
    monkeypatch.delenv("KVCOMPRESS_KERNELS", raising=False)
    monkeypatch.delenv("KVCOMPRESS_PROMPTS", raising=False)
    assert not uses_flash_prompts(torch.bfloat16, torch.device("cuda"))
    monkeypatch.setenv("KVCOMPRESS_PROMPTS", "flash")
    assert uses_flash_prompts(torch.bfloat16, torch.device("cuda"))
    assert not uses_flash_prompts(torch.bfloat16, torch.device("cpu"))  # prompts take the torch path there


def _varlen_attention(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """What FlashAttention's varlen prefill computes, in torch: causal attention within each segment."""
    bounds = cu_seqlens_q.tolist()
    for s, e in zip(bounds, bounds[1:]):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].float().transpose(0, 1), k[s:e].float().transpose(0, 1), v[s:e].float().transpose(0, 1),
            is_causal=causal, scale=softmax_scale, enable_gqa=True)
        out[s:e] = o.transpose(0, 1).to(out.dtype)


def test_backend_step_equals_reference(monkeypatch):
    """The backend's forward over a step of two decodes, a chunk with history and two prompts, with
    FlashAttention for prompts: every row equals the reference, the prompts went to FlashAttention
    (over the prompt chunks' offsets) and the chunk with history to the decode kernel's rows. On the
    CPU, FlashAttention is replaced by the same attention in torch; on a GPU it is vLLM's."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_kvcompress.backend import KVCompressImpl, KVCompressMetadataBuilder
    from vllm_kvcompress.triton_kernels.decode import paged_decode, rows_per_program

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    B, H, HQ, D = 16, 2, 4, 64
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), dtype, B, H, D)
    seq_lens, q_lens = [21, 9, 40, 9, 33], [1, 1, 25, 9, 33]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    cache, table = fill_pages(fmt, seq_lens, 2, seed=21)
    query = torch.randn(qsl[-1], HQ * D, generator=torch.Generator().manual_seed(22)).to(dtype)
    ref = paged_torch.attend(query.view(-1, HQ, D).float(), cache, fmt, qsl, seq_lens, table, D ** -0.5)

    flash_calls = []
    if device == "cpu":
        def flash(**kw):
            flash_calls.append(kw["cu_seqlens_q"].tolist())
            _varlen_attention(**kw)
        monkeypatch.setattr(prompt_attention, "_flash_attention", lambda head_size: (flash, None))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build of torch has none
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    slots = _slots(table, B, seq_lens, q_lens)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl_t.to(device), query_start_loc_cpu=qsl_t, seq_lens=lens.to(device), num_reqs=len(q_lens),
        num_actual_tokens=qsl[-1], max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table.to(device), slot_mapping=slots.to(device), seq_lens_cpu_upper_bound=lens)
    builder = SimpleNamespace(device=torch.device("cuda"), _rows_per_group=rows_per_program(HQ // H),
                              _row_order=torch.zeros(8, dtype=torch.int32, device=device), _flash_prompts=True)
    md = KVCompressMetadataBuilder.build(builder, 0, cam)
    assert md.num_decodes == 2 and md.first_chunks is not None and md.token_rows is not None

    impl = object.__new__(KVCompressImpl)
    cache = cache.to(device)
    impl.__dict__.update(num_heads=HQ, head_size=D, num_kv_heads=H, scale=D ** -0.5, sliding_window=None,
                         _format=fmt, _decode_kernel=paged_decode, _warm_up=None, _max_model_len=1024,
                         _kv_cache=cache, _cache_pages=cache)
    output = torch.full((qsl[-1], HQ * D), float("nan"), dtype=dtype, device=device)
    q = query.to(device)
    impl.forward(SimpleNamespace(), q, q, q, cache, md, output)
    torch.testing.assert_close(output.view(-1, HQ, D).float().cpu(), ref, rtol=2e-2, atol=2e-2)
    if device == "cpu":
        assert flash_calls == [[0, 25, 34, 67]]
