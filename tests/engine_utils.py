"""Running a real vLLM CPU engine in the test process, and a torch reference model."""

from __future__ import annotations

import contextlib
import gc
import random

import torch

from reference_quant import fake_quant
from tiny_models import CORPUS

WORDS = CORPUS.replace(".", " .").split()


def prose(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@contextlib.contextmanager
def engine(model, kv_compression=None, dtype="float32", kv_bytes=32 << 20, max_model_len=1024, **kwargs):
    from vllm import LLM

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


def reference_prompt_logprobs(model_dir, prompts, k_bits: int, v_bits: int, block: int) -> list[torch.Tensor]:
    """Hugging Face Llama whose attention sees K and V through the format's arithmetic."""
    from transformers import AttentionInterface, AutoTokenizer, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def quantized_attention(module, query, key, value, attention_mask, **kwargs):
        # key/value: [batch, kv_heads, seq, head] after RoPE, as vLLM stores them
        k = torch.stack([fake_quant(kb.transpose(0, 1), k_bits, "channel", block).transpose(0, 1) for kb in key])
        v = torch.stack([fake_quant(vb.transpose(0, 1), v_bits, "token", block).transpose(0, 1) for vb in value])
        return sdpa_attention_forward(module, query, k.to(query.dtype), v.to(query.dtype), attention_mask, **kwargs)

    AttentionInterface.register("kvq_reference", quantized_attention)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="kvq_reference", dtype=torch.float32)
    result = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            logp = model(ids).logits[0].log_softmax(-1)
            result.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return result


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
