"""The backend's per-step metadata: which requests decode, in what order, and the prompt tokens' rows.

``build`` is called unbound with the few attributes it reads, as the engine would set them on a
GPU (the tensors stay on the CPU: the metadata is indices, checked against numbers worked by hand).
"""

import os
from types import SimpleNamespace

# the backend imports the Triton kernels' modules: Triton's interpreter must be chosen before they
# are (the CPU suite runs the kernels' tests in it, in the same process)
os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm_kvcompress.backend import KVCompressMetadataBuilder  # noqa: E402


def _build(q_lens: list[int], seq_lens: list[int], rows_per_group: int = 1):
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    n = len(q_lens)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, num_reqs=n,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.arange(n * 4, dtype=torch.int32).view(n, 4),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), seq_lens_cpu_upper_bound=lens)
    builder = SimpleNamespace(device=torch.device("cuda"), _rows_per_group=rows_per_group,
                              _row_order=torch.full((8,), -1, dtype=torch.int32))
    return KVCompressMetadataBuilder.build(builder, 0, cam), builder._row_order


def test_cuda_graph_padding_is_decode_rows_not_prompts():
    """A full CUDA graph's batch of 5 holding 3 decodes: the 2 padding requests have no tokens. They
    must not count as prompts (no prompt rows built), and the captured launch's rows for them must
    come last in the order rather than keep a previous step's entries."""
    md, order_buffer = _build([1, 1, 1, 0, 0], [5, 9, 7, 0, 0])
    assert md.num_decodes == 3
    assert md.token_rows is None
    assert md.decode_row_order.tolist() == [1, 2, 0]
    assert order_buffer[:3].tolist() == [1, 2, 0] and sorted(order_buffer[3:5].tolist()) == [3, 4]
    assert order_buffer[5:].tolist() == [-1] * 3


def test_mixed_step_rows():
    """Two decodes, then a 5-token chunk after 7 tokens and a 2-token prompt, grouped 4 tokens a
    program: each prompt token a row over its chunk's history (the tokens before the chunk)."""
    md, order_buffer = _build([1, 1, 5, 2], [5, 9, 12, 2], rows_per_group=4)
    assert md.num_decodes == 2
    assert md.decode_row_order.tolist() == [1, 0] and order_buffer[2:].tolist() == [-1] * 6
    rows = md.token_rows
    assert rows.seq_lens.tolist() == [7] * 5 + [0] * 2
    assert rows.block_table.tolist() == [[8, 9, 10, 11]] * 5 + [[12, 13, 14, 15]] * 2
    assert rows.max_seq_len == 7 and rows.histories == [7, 0]  # the host's, for the history route's plan
    assert rows.query_start.tolist() == [0, 5, 7] and rows.query_start_host == [0, 5, 7] and rows.max_query_len == 5
    assert rows.groups.rows.tolist() == [4, 0, 0, 0, 1, 2, 0]
    assert rows.groups.starts.tolist() == [0, 4, 5]
    # the Triton kernel is compiled for 16-byte aligned pointers (warm-up included): another
    # alignment would compile a new variant in the middle of serving
    assert all(t.data_ptr() % 16 == 0 for t in (rows.seq_lens, rows.groups.rows, rows.groups.starts,
                                                 rows.query_start))


@pytest.mark.parametrize("window", [None, 12], ids=["full", "sliding-window"])
def test_backend_step_equals_reference(monkeypatch, window):
    """The backend's forward over a step of two decodes, a chunk with history and two prompts: the
    decodes through the decode kernel, the prompts through the prompt path (their own tokens
    exactly, their history as grouped rows of the decode kernel), each row equal to the torch
    reference over the pages and the step's new K/V (Triton's interpreter on the CPU, where a torch
    attention stands in for FlashAttention). A sliding-window layer's rows see their windows, the
    pages before them freed (NaN)."""
    from paged_cases import fill_pages, free_before, request_slots
    from test_triton_prompt import torch_own_chunk_attention

    from vllm_kvcompress import paged_torch
    from vllm_kvcompress.backend import KVCompressImpl
    from vllm_kvcompress.config import LayerFormat
    from vllm_kvcompress.formats import KVPageFormat
    from vllm_kvcompress.triton_kernels import prompt
    from vllm_kvcompress.triton_kernels.decode import paged_decode, rows_per_program

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    B, H, HQ, D = 16, 2, 4, 64
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), dtype, B, H, D)
    seq_lens, q_lens = [37, 9, 40, 9, 33], [1, 1, 25, 9, 33]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    cache, table = fill_pages(fmt, seq_lens, 2, seed=21)
    if window is not None:  # each request's first token of the step sees keys from p - window + 1 on
        cache, table = free_before(cache, table, [L - m - window + 1 for L, m in zip(seq_lens, q_lens)], B)
    gen = torch.Generator().manual_seed(22)
    query, key, value = (torch.randn(qsl[-1], n * D, generator=gen).to(dtype) for n in (HQ, H, H))
    ref = paged_torch.attend(query.view(-1, HQ, D).float(), cache, fmt, qsl, seq_lens, table, D ** -0.5, window,
                             key=key.view(-1, H, D), value=value.view(-1, H, D))
    if device == "cpu":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build of torch has none
        monkeypatch.setattr(prompt, "own_chunk_attention", torch_own_chunk_attention)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    slots = torch.cat([request_slots(table[i], B, torch.arange(L - m, L)) for i, (L, m) in enumerate(zip(seq_lens,
                                                                                                       q_lens))])
    cam = CommonAttentionMetadata(
        query_start_loc=qsl_t.to(device), query_start_loc_cpu=qsl_t, seq_lens=lens.to(device), num_reqs=len(q_lens),
        num_actual_tokens=qsl[-1], max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table.to(device), slot_mapping=slots.to(device), seq_lens_cpu_upper_bound=lens)
    builder = SimpleNamespace(device=torch.device("cuda"), _rows_per_group=rows_per_program(HQ // H),
                              _row_order=torch.zeros(8, dtype=torch.int32, device=device))
    md = KVCompressMetadataBuilder.build(builder, 0, cam)
    assert md.num_decodes == 2 and md.token_rows is not None

    impl = object.__new__(KVCompressImpl)
    cache = cache.to(device)
    impl.__dict__.update(num_heads=HQ, head_size=D, num_kv_heads=H, scale=D ** -0.5, sliding_window=window,
                         _format=fmt, _decode_kernel=paged_decode, _prompt_kernel=prompt.paged_prompt, _warm_ups=[],
                         _max_model_len=1024, _kv_cache=cache, _cache_pages=cache)
    output = torch.full((qsl[-1], HQ * D), float("nan"), dtype=dtype, device=device)
    impl.forward(SimpleNamespace(), query.to(device), key.to(device), value.to(device), cache, md, output)
    torch.testing.assert_close(output.view(-1, HQ, D).float().cpu(), ref, rtol=2e-2, atol=2e-2)


def test_backend_zipcache_step_on_the_kernels_equals_its_torch_path(monkeypatch):
    """ZipCache's forward over a step of two decodes, a chunk after its history and a fresh prompt:
    through the kernels (decode rows, their write, the prompt chunks and their write) against the
    backend's torch path (every request through ``attend_and_write``): the same outputs and, on the
    CPU, the same pages after the step (the same 4-bit tokens, the same values read)."""
    from test_triton_history import torch_chunks_attention
    from test_triton_prompt import torch_own_chunk_attention

    from vllm_kvcompress.backend import KVCompressImpl
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.formats.salient import SalientTokensFormat
    from vllm_kvcompress.salient_torch import attend_and_write
    from vllm_kvcompress.triton_kernels import history, prompt, salient_decode, salient_prompt, salient_write
    from vllm_kvcompress.triton_kernels.decode import rows_per_program

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build of torch has none
        monkeypatch.setattr(prompt, "own_chunk_attention", torch_own_chunk_attention)
        monkeypatch.setattr(history, "chunks_attention", torch_chunks_attention)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # FlashAttention takes 16-bit inputs
    B, H, HQ, D = 32, 2, 4, 64
    fmt = SalientTokensFormat.create(0.5, dtype, B, H, D)
    spec = SalientSpec(ratio=0.5)
    g = torch.Generator().manual_seed(13)
    table = torch.arange(4 * 4, dtype=torch.int32).view(4, 4)
    cache = torch.zeros(16, fmt.page_bytes, dtype=torch.uint8)
    for i, L in enumerate([70, 40, 20]):  # the earlier prompts of the decodes and of the chunk
        q, k, v = (torch.randn(L, n, D, generator=g).to(dtype) for n in (HQ, H, H))
        attend_and_write(q, k, v, cache, fmt, spec, [0, L], [L], table[i:i + 1], D ** -0.5)
    seq_lens, q_lens = [71, 41, 45, 37], [1, 1, 25, 37]
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=lens.to(device), num_reqs=4,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table.to(device), slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=lens)
    builder = SimpleNamespace(device=torch.device("cuda"), _rows_per_group=rows_per_program(HQ // H),
                              _row_order=torch.zeros(8, dtype=torch.int32, device=device))
    md = KVCompressMetadataBuilder.build(builder, 0, cam)
    assert md.num_decodes == 2 and md.token_rows is not None
    query, key, value = (torch.randn(int(qsl[-1]), n * D, generator=g).to(dtype) for n in (HQ, H, H))

    def forward(pages, **kernels):
        impl = object.__new__(KVCompressImpl)
        impl.__dict__.update(num_heads=HQ, head_size=D, num_kv_heads=H, scale=D ** -0.5, sliding_window=None,
                             _format=fmt, _config=SimpleNamespace(salient=spec), _warm_ups=[], _max_model_len=1024,
                             _kv_cache=pages, _cache_pages=pages, **kernels)
        output = torch.full((int(qsl[-1]), HQ * D), float("nan"), dtype=dtype, device=device)
        impl.forward(SimpleNamespace(), query.to(device), key.to(device), value.to(device), pages, md, output)
        return output.view(-1, HQ, D).float().cpu()

    ours, theirs = cache.clone().to(device), cache.clone().to(device)
    got = forward(ours, _decode_kernel=salient_decode.decode_rows, _write=salient_write.write_decoded,
                  _prompt_kernel=salient_prompt.salient_prompt)
    want = forward(theirs, _decode_kernel=None, _prompt_kernel=None)
    tol = 2e-2 if device == "cpu" else 3e-2  # the decode kernel's float16 factors
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if device == "cpu":  # on a GPU, TF32 products may flip near-ties of the choice
        assert torch.equal(fmt.salient(ours), fmt.salient(theirs))
        for i, L in enumerate(seq_lens):
            blocks = table[i, :-(-L // B)].long()
            for a, b in zip(fmt.decode(ours[blocks]), fmt.decode(theirs[blocks])):
                torch.testing.assert_close(a.flatten(0, 1)[:L], b.flatten(0, 1)[:L], rtol=0, atol=1e-6)
