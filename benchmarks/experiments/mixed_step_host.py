"""The host's work in one layer of a step with prompts, on the CUDA route, with the kernels' launches
mocked so that it runs on any machine: the aten ops the layer's attention calls and its host time,
zipcache-r60 against quant-k4v4 (Llama-2-7B shape: 188 decode rows and three fresh prompts of 260,
ShareGPT's median step of 513 to 2,048 tokens), and ZipCache's step plan.

    python -m benchmarks.experiments.mixed_step_host

What it leaves out: the launches themselves (the CUDA kernels' ctypes calls, Triton's launcher,
FlashAttention's), a few microseconds each on a GPU host, and the backend's views of q, k, v and
out, the same in both settings.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HEADS, HEAD_SIZE, BLOCK, DECODE_ROWS, CONTEXT = 32, 128, 128, 188, 500
PROMPTS = [260, 260, 260]
SCALE = HEAD_SIZE ** -0.5


@contextlib.contextmanager
def kernels_mocked():
    """Every launch a no-op (Triton's: its arguments' specialization kept, the host part of ``launch``)."""
    from vllm_kvcompress import cuda_decode, cuda_jit
    from vllm_kvcompress.triton_kernels import launch, prompt, salient_write

    def own_tokens(query, key, value, query_start, max_query_len, key_start, max_key_len, sm_scale, out,
                   window=None):
        return torch.empty(query.shape[1], query.shape[0])

    class Compiled:  # what launch returns: a kernel a step's later layers run again (their plans)
        def run(self, grid, stream, args):
            pass

    def specialized(variant, grid, args):
        launch._specialization(args)
        return Compiled()

    with mock.patch.object(cuda_jit.Kernel, "__call__", lambda self, args: None), \
            mock.patch.object(launch, "stream_handle", lambda device: 0), \
            mock.patch.object(salient_write, "stream_handle", lambda device: 0), \
            mock.patch.object(salient_write, "plannable", lambda device: True), \
            mock.patch.object(cuda_decode, "choose_num_splits", lambda *args: 4), \
            mock.patch.object(prompt, "chunks_attention", own_tokens), \
            mock.patch.object(salient_write, "launch", specialized):
        yield


def layers() -> dict:
    """A layer's attention in each setting, as the backend calls it in such a step, on CPU tensors."""
    from vllm_kvcompress import cuda_decode, cuda_salient_decode, cuda_salient_write, cuda_write
    from vllm_kvcompress.config import SalientSpec, load_config
    from vllm_kvcompress.engine_config import layer_page_format
    from vllm_kvcompress.formats.salient import SalientTokensFormat
    from vllm_kvcompress.salient_torch import plan_chunk_writes
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels.history import prompt_chunks
    from vllm_kvcompress.triton_kernels.salient_prompt import salient_prompt

    nd, t = DECODE_ROWS, DECODE_ROWS + sum(PROMPTS)
    q, k, v = (torch.randn(t, HEADS, HEAD_SIZE, dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    table = torch.arange(nd * 8, dtype=torch.int32).view(nd, 8)
    lens = torch.full((nd,), CONTEXT, dtype=torch.int32)
    prompt_table = torch.arange(len(PROMPTS) * 4, dtype=torch.int32).view(len(PROMPTS), 4)
    starts = [0]
    for m in PROMPTS:
        starts.append(starts[-1] + m)
    rows = token_rows(starts, [0] * len(PROMPTS), prompt_table)
    salient = SalientTokensFormat.create(0.6, torch.bfloat16, BLOCK, HEADS, HEAD_SIZE)
    spec = SalientSpec(ratio=0.6, score="normalized")
    quant = layer_page_format(load_config("quant-k4v4"), 0, 32, torch.bfloat16, BLOCK, HEADS, HEAD_SIZE)
    salient_pages, quant_pages = (torch.zeros(8, f.page_bytes, dtype=torch.uint8) for f in (salient, quant))
    writes = plan_chunk_writes(salient, spec, starts, PROMPTS, prompt_table)
    slots = torch.arange(t)

    def zipcache():
        qd, kd, vd = q[:nd], k[:nd], v[:nd]
        lse = cuda_salient_decode.decode_rows(qd, kd, vd, salient_pages, salient, table, lens, SCALE, CONTEXT,
                                              out[:nd])
        cuda_salient_write.write_decoded(qd, kd, vd, salient_pages, salient, spec, table, lens, lse.t(), SCALE)
        salient_prompt(q[nd:], k[nd:], v[nd:], salient_pages, salient, spec, rows, writes, SCALE, out[nd:])

    def quant_k4v4():
        cuda_write.write_tokens(quant_pages, quant, k, v, slots)  # the layer's cache update, before attention
        cuda_decode.paged_decode(q[:nd], quant_pages, quant, table, lens, SCALE, CONTEXT, out=out[:nd])
        prompt_chunks(q[nd:], k[nd:], v[nd:], quant_pages, quant, rows, SCALE, out[nd:])

    def plan():
        plan_chunk_writes(salient, spec, starts, PROMPTS, prompt_table)

    return {"zipcache-r60": zipcache, "quant-k4v4": quant_k4v4, "ZipCache's step plan": plan}


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def measure(run, repeats: int = 300) -> tuple[Counter, float]:
    """The aten ops one call of ``run`` makes and its host time in us (after a first call)."""
    run()
    with _AtenOps() as counted:
        run()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return counted.ops, (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    with kernels_mocked():
        for name, run in layers().items():
            ops, us = measure(run)
            print(f"{name:22s} {sum(ops.values()):3d} aten ops, {us:6.0f} us host: "
                  + ", ".join(f"{op} x{n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
