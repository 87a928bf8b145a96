"""The backend's per-step metadata: which requests decode, in what order, and the prompt tokens' rows.

``build`` is called unbound with the few attributes it reads, as the engine would set them on a
GPU (the tensors stay on the CPU: the metadata is indices, checked against numbers worked by hand).
"""

import os
from types import SimpleNamespace

# the backend imports the Triton kernels' modules: Triton's interpreter must be chosen before they
# are (the CPU suite runs the kernels' tests in it, in the same process)
os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import torch  # noqa: E402

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm_kvcompress.backend import KVCompressMetadataBuilder  # noqa: E402


def _build(q_lens: list[int], seq_lens: list[int], rows_per_group: int = 1, flash_prompts: bool = False):
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    n = len(q_lens)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, num_reqs=n,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.arange(n * 4, dtype=torch.int32).view(n, 4),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), seq_lens_cpu_upper_bound=lens)
    builder = SimpleNamespace(device=torch.device("cuda"), _rows_per_group=rows_per_group,
                              _row_order=torch.full((8,), -1, dtype=torch.int32), _flash_prompts=flash_prompts)
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
    program: each prompt token a row whose context ends at itself."""
    md, order_buffer = _build([1, 1, 5, 2], [5, 9, 12, 2], rows_per_group=4)
    assert md.num_decodes == 2
    assert md.decode_row_order.tolist() == [1, 0] and order_buffer[2:].tolist() == [-1] * 6
    rows = md.token_rows
    assert rows.seq_lens.tolist() == [8, 9, 10, 11, 12, 1, 2]
    assert rows.block_table.tolist() == [[8, 9, 10, 11]] * 5 + [[12, 13, 14, 15]] * 2
    assert rows.max_seq_len == 12
    assert rows.groups.rows.tolist() == [4, 0, 0, 0, 1, 2, 0]
    assert rows.groups.starts.tolist() == [0, 4, 5]
    # the Triton kernel is compiled for 16-byte aligned pointers (warm-up included): another
    # alignment would compile a new variant in the middle of serving
    assert all(t.data_ptr() % 16 == 0 for t in (rows.seq_lens, rows.groups.rows, rows.groups.starts))


def test_mixed_step_with_flash_prompts():
    """The step above with FlashAttention for prompts: every prompt chunk is in its launch (offsets
    from the first prompt token), and only the chunk with history gets rows of the decode kernel."""
    md, _ = _build([1, 1, 5, 2], [5, 9, 12, 2], rows_per_group=4, flash_prompts=True)
    assert md.first_chunks.cu_seqlens.tolist() == [0, 5, 7] and md.first_chunks.max_len == 5
    rows = md.token_rows
    assert rows.seq_lens.tolist() == [8, 9, 10, 11, 12, 0, 0]  # context 0: no rows to merge
    assert rows.groups.starts.tolist() == [0, 4]
    assert rows.groups.rows[[0, 4]].tolist() == [4, 1]
    assert rows.max_seq_len == 12


def test_flash_prompts_without_history_need_no_rows():
    """Two first chunks and a chunk with history of a single request, one group a token: no rows
    where every chunk starts its context; groups even at one token a group where one has history
    (ungrouped rows would launch every prompt token)."""
    md, _ = _build([1, 3, 2], [4, 3, 2], flash_prompts=True)
    assert md.token_rows is None and md.first_chunks.cu_seqlens.tolist() == [0, 3, 5]
    md, _ = _build([3, 2], [3, 6], flash_prompts=True)
    assert md.first_chunks.cu_seqlens.tolist() == [0, 3, 5]
    assert md.token_rows.groups.starts.tolist() == [3, 4] and md.token_rows.max_seq_len == 6
    md, _ = _build([3, 2], [5, 6], flash_prompts=True)
    assert md.first_chunks is None and md.token_rows.groups.starts.tolist() == [0, 1, 2, 3, 4]
