"""Tiny random-weight Llama models with a locally trained byte-level BPE tokenizer.

Built in seconds with transformers; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Serving large language models needs memory for "
    "the key value cache of every request. Paged attention stores it in fixed blocks. "
    "Quantization keeps fewer bits per value; a scale and a zero point restore the range. "
    "Once upon a time there was a small model that answered questions about numbers: 1 2 3 4 5 6 7 8 9 10. "
)


def build_tokenizer(path: Path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(path)
    return fast


def build_llama(path: Path, num_kv_heads: int = 4, num_heads: int = 4, hidden: int = 256,
                layers: int = 4, seed: int = 0, init_range: float = 0.02, train_steps: int = 150,
                attention_bias: bool = False, max_cond_k: float | None = None) -> Path:
    """Write a small Llama (head size hidden/num_heads) and its tokenizer to ``path``.

    A few training steps on ``CORPUS`` make its greedy choices confident, as a
    real model's are, so token-level comparisons are not decided by near-ties.
    ``max_cond_k``: after every training step, each layer's (square) W_K has its small singular
    values raised to ``1 / max_cond_k`` of its largest (projected training: the model learns with
    the bound, so its greedy choices stay confident), so slim attention's conditioning does not
    depend on how this CPU's arithmetic steered the training (one machine's run gave 3e3..4e5).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=2048, attention_bias=attention_bias,
                         initializer_range=init_range, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    def bound_k_conditioning():
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight
            u, s, vh = torch.linalg.svd(w.double())
            w.copy_((u * s.clamp(min=s.max() / max_cond_k)) @ vh)

    _train(model, tok, train_steps, after_step=bound_k_conditioning if max_cond_k is not None else None)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _train(model, tok, steps: int, seq: int = 64, batch: int = 8, after_step=None) -> None:
    import torch

    ids = torch.tensor(tok(CORPUS * 8).input_ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[i:i + seq] for i in starts])
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            with torch.no_grad():
                after_step()


def llama_as_phi3(llama_dir: Path, path: Path) -> Path:
    """The Llama at ``llama_dir`` rewritten as Phi-3: the same function, but Q, K and V come
    from one fused ``qkv_proj`` (rows [q | k | v]) and gate/up from one ``gate_up_proj``."""
    import torch
    from transformers import LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "config.json").exists():
        return path
    llama = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    c = llama.config
    config = Phi3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                        rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters, tie_word_embeddings=False,
                        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=None,
                        torch_dtype="float32")
    sd, fused = llama.state_dict(), {}
    for name, w in sd.items():
        if ".q_proj." in name:
            fused[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [w, sd[name.replace("q_proj", "k_proj")], sd[name.replace("q_proj", "v_proj")]])
        elif ".gate_proj." in name:
            fused[name.replace("gate_proj", "gate_up_proj")] = torch.cat([w, sd[name.replace("gate_proj", "up_proj")]])
        elif not any(s in name for s in (".k_proj.", ".v_proj.", ".up_proj.")):
            fused[name] = w
    phi3 = Phi3ForCausalLM(config)
    phi3.load_state_dict(fused, strict=True)
    phi3.save_pretrained(path, safe_serialization=True)
    PreTrainedTokenizerFast.from_pretrained(llama_dir).save_pretrained(path)
    return path


def build_fused_qkv(path: Path, arch: str, hidden: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                    seed: int = 0) -> Path:
    """A tiny random model whose attention has one fused QKV weight, with the tokenizer above:
    ``gpt2`` (Conv1D ``c_attn``, [in, q|k|v]), ``gpt_neox`` (``query_key_value``, per head [q|k|v]),
    ``falcon`` (new decoder architecture: per KV head [its queries|k|v])."""
    import torch
    from transformers import (FalconConfig, FalconForCausalLM, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig,
                              GPTNeoXForCausalLM)

    path = Path(path)
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024, **ids))
    elif arch == "gpt_neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                                 intermediate_size=2 * hidden, **ids))
    elif arch == "falcon":
        model = FalconForCausalLM(FalconConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                               num_kv_heads=kv_heads, new_decoder_architecture=True, **ids))
    else:
        raise ValueError(arch)
    model.save_pretrained(path, safe_serialization=True)
    return path
