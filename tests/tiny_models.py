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
                layers: int = 4, seed: int = 0, init_range: float = 0.02, train_steps: int = 150) -> Path:
    """Write a small Llama (head size hidden/num_heads) and its tokenizer to ``path``.

    A few training steps on ``CORPUS`` make its greedy choices confident, as a
    real model's are, so token-level comparisons are not decided by near-ties.
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
                         num_key_value_heads=num_kv_heads, max_position_embeddings=2048,
                         initializer_range=init_range, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    _train(model, tok, train_steps)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _train(model, tok, steps: int, seq: int = 64, batch: int = 8) -> None:
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
