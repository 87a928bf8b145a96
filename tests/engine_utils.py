"""Running a real vLLM CPU engine in the test process, and a torch reference model."""

from __future__ import annotations

import contextlib
import gc
import random

import pytest
import torch

from reference_quant import fake_quant, fake_quant_with_outliers
from tiny_models import CORPUS

WORDS = CORPUS.replace(".", " .").split()


def prose(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@contextlib.contextmanager
def engine(model, kv_compression=None, dtype="float32", kv_bytes=32 << 20, max_model_len=1024, **kwargs):
    from vllm import LLM

    if dtype == "float32" and torch.cuda.is_available():
        pytest.skip("a float32 engine is vLLM's CPU engine (CUDA serves float16 and bfloat16 with --kv-compression)")
    extra = {"additional_config": {"kv_compression": kv_compression}} if kv_compression is not None else {}
    llm = LLM(str(model), enforce_eager=True, kv_cache_memory_bytes=kv_bytes, dtype=dtype, seed=0,
              max_model_len=max_model_len, **extra, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def kv_capacity_tokens(llm) -> int:
    cc = llm.llm_engine.vllm_config.cache_config
    return cc.num_gpu_blocks * cc.block_size


def attention_backends(llm) -> set[str]:
    names = llm.llm_engine.collective_rpc(_backend_names)
    return set(names[0])


def _backend_names(worker) -> list[str]:
    from vllm.model_executor.layers.attention.attention import Attention
    model = worker.model_runner.model
    return sorted({m.attn_backend.get_name() for m in model.modules() if isinstance(m, Attention)})


def greedy(llm, prompts, max_tokens=32) -> list[list[int]]:
    from vllm import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def prompt_logprobs(llm, prompts) -> list[torch.Tensor]:
    """Log-probability of each prompt token (from the 2nd on) given its prefix."""
    from vllm import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    result = []
    for o in outs:
        ids = o.prompt_token_ids
        result.append(torch.tensor([lp[ids[i]].logprob for i, lp in enumerate(o.prompt_logprobs) if i > 0]))
    return result


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The orthonormal Hadamard matrix from its closed form: entry (i, j) is (-1)^popcount(i & j) / sqrt(n)."""
    i = torch.arange(n)
    bits = (i[:, None] & i[None, :]).flatten().tolist()
    signs = torch.tensor([1.0 - 2.0 * (bin(b).count("1") % 2) for b in bits]).view(n, n)
    return signs / n ** 0.5


def reference_prompt_logprobs(model_dir, prompts, k_bits: int, v_bits: int, block: int,
                              chunk: int, outliers: int = 0, v_turned: bool = False) -> list[torch.Tensor]:
    """Hugging Face Llama run as the engine runs a prompt in chunks of ``chunk`` tokens (a multiple
    of ``block``): each chunk attends to its own K/V exactly and to earlier chunks' K/V through the
    format's arithmetic (with ``outliers``, each block's most deviant tokens kept exact; with
    ``v_turned``, V quantized without its projection's bias after turning by the Hadamard matrix,
    then turned back and the bias added)."""
    import torch.nn.functional as F
    from transformers import AttentionInterface, AutoTokenizer, LlamaForCausalLM

    assert not (outliers and v_turned), "one lever at a time"

    def quant_v(v, bias):  # [T, H, D], [H, D]
        if not v_turned:
            return fake_quant(v, v_bits, "token", block)
        h = sylvester_hadamard(v.shape[-1])
        return fake_quant((v - bias) @ h, v_bits, "token", block) @ h.T + bias

    def chunked_quantized_attention(module, query, key, value, attention_mask, **kwargs):
        # query [batch, heads, seq, head]; key/value [batch, kv_heads, seq, head] after RoPE, as vLLM stores them
        if outliers:
            both = [fake_quant_with_outliers(kb.transpose(0, 1), vb.transpose(0, 1), k_bits, v_bits, block, outliers)
                    for kb, vb in zip(key, value)]
            kq = torch.stack([k.transpose(0, 1) for k, _, _ in both])
            vq = torch.stack([v.transpose(0, 1) for _, v, _ in both])
        else:
            kq = torch.stack([fake_quant(kb.transpose(0, 1), k_bits, "channel", block).transpose(0, 1) for kb in key])
            bias = module.v_proj.bias
            bias = torch.zeros(value.shape[1], value.shape[-1]) if bias is None else bias.view(value.shape[1], -1)
            vq = torch.stack([quant_v(vb.transpose(0, 1), bias).transpose(0, 1) for vb in value])
        outs = []
        for a in range(0, key.shape[2], chunk):
            b = min(a + chunk, key.shape[2])
            k = torch.cat([kq[:, :, :a], key[:, :, a:b]], 2).to(query.dtype)
            v = torch.cat([vq[:, :, :a], value[:, :, a:b]], 2).to(query.dtype)
            mask = torch.ones(b - a, b, dtype=torch.bool).tril(a)
            outs.append(F.scaled_dot_product_attention(query[:, :, a:b], k, v, attn_mask=mask, scale=module.scaling,
                                                       enable_gqa=True))
        return torch.cat(outs, 2).transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvq_reference", chunked_quantized_attention)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="kvq_reference", dtype=torch.float32)
    result = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            logp = model(ids).logits[0].log_softmax(-1)
            result.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return result


def assert_equal_to_reference(got, want, without, effect: float) -> None:
    """Prompt logprobs from the engine (``got``) equal the reference's (``want``): median token within
    1e-4, every token within 5e-2 (a block whose min/max crosses a float16 rounding step of its
    scale shifts all its codes); and the reference without the lever under test (``without``)
    differs somewhere by more than ``effect``, so the check tells the two apart."""
    for g, w, p in zip(got, want, without):
        diff = (g - w).abs()
        print(f"max {diff.max():.2e}, p99 {diff.quantile(0.99):.2e}, lever's effect {(p - w).abs().max():.2e}")
        assert diff.median() < 1e-4 and diff.max() < 5e-2, (diff.median(), diff.max())
        assert (p - w).abs().max() > effect


def record_attention(monkeypatch) -> list:
    """Every attention call of the backend in this process from now on, a profiling run's aside:
    the layer's name, heads, scale, the step's query offsets and context lengths, and its query,
    key, value and output rows (copies)."""
    from types import SimpleNamespace

    from vllm_kvcompress.backend import KVCompressImpl

    calls = []
    original = KVCompressImpl.forward

    def recording_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is not None:
            t = attn_metadata.num_actual_tokens
            calls.append(SimpleNamespace(
                layer=layer.layer_name, heads=self.num_heads, kv_heads=self.num_kv_heads, scale=self.scale,
                qsl=list(attn_metadata.query_start_loc), seq_lens=list(attn_metadata.seq_lens),
                q=query[:t].clone(), k=key[:t].clone(), v=value[:t].clone(), out=output[:t].clone()))
        return result

    monkeypatch.setattr(KVCompressImpl, "forward", recording_forward)
    return calls


def check_chunked_attention(calls, history_k, history_v) -> int:
    """Recorded attention calls of prompts run one at a time in chunks, each against causal attention
    over the chunk's own K/V exactly and over the request's earlier tokens (from the layer's earlier
    calls) put through ``history_k``/``history_v`` ([T, H, D] -> the values the pages give back).
    Returns how many calls had earlier tokens."""
    before = {}  # by layer: the request's K and V so far
    with_history = 0
    for c in calls:
        assert len(c.qsl) == 2, "one request a step"
        d = c.q.shape[-1] // c.heads if c.q.dim() == 2 else c.q.shape[-1]
        q, k, v, out = (t.reshape(t.shape[0], -1, d).float() for t in (c.q, c.k, c.v, c.out))
        m, length = q.shape[0], c.seq_lens[0]
        if length == m:
            before[c.layer] = (k[:0], v[:0])
        old_k, old_v = before[c.layer]
        assert old_k.shape[0] == length - m
        with_history += length > m
        group = c.heads // c.kv_heads
        if length > m:
            old_k, old_v = history_k(old_k), history_v(old_v)
        keys = torch.cat([old_k, k]).repeat_interleave(group, 1)
        values = torch.cat([old_v, v]).repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * c.scale
        scores = scores.masked_fill(~torch.ones(m, length, dtype=torch.bool).tril(length - m), float("-inf"))
        torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", scores.softmax(-1), values),
                                   rtol=1e-4, atol=1e-4)
        before[c.layer] = (torch.cat([before[c.layer][0], k]), torch.cat([before[c.layer][1], v]))
    return with_history
