"""Fake quantization of a Hugging Face model's K/V: K's statistics per channel over a block (the
"quant" page) against per token, with and without a Hadamard rotation of each head's channels.

Per-token codes are written once, whatever else a block holds, so a request's tokens do not
depend on how its prompt was chunked or what shared its batch; per-channel statistics over a
block change as the block fills. This measures what that invariance costs in perplexity.

    python -m benchmarks.experiments.token_axis models/smollm2-135m-instruct --tokens 2048
"""

from __future__ import annotations

import argparse
import math

import torch


def fake_quant(x: torch.Tensor, bits: int, axis: str, block: int) -> torch.Tensor:
    """x: [batch, heads, seq, d]. axis 'token': min-max over d per token; 'channel': per channel
    over each block of ``block`` tokens (float16 scale and zero, as the pages store them)."""
    top = 2 ** bits - 1
    if axis == "token":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        zero = lo.half().float()
        scale = ((hi - zero) / top).half().float().clamp_min(1e-8)
        return (torch.clamp(torch.floor((x - zero) / scale + 0.5), 0, top) * scale + zero)
    b, h, s, d = x.shape
    pad = (-s) % block
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(b, h, -1, block, d)
    mask = torch.arange(s + pad, device=x.device).view(-1, block) < s
    big = torch.finfo(x.dtype).max
    lo = torch.where(mask[None, None, :, :, None], xp, big).amin(3, keepdim=True)
    hi = torch.where(mask[None, None, :, :, None], xp, -big).amax(3, keepdim=True)
    zero = lo.half().float()
    scale = ((hi - zero) / top).half().float().clamp_min(1e-8)
    q = torch.clamp(torch.floor((xp - zero) / scale + 0.5), 0, top) * scale + zero
    return q.view(b, h, -1, d)[:, :, :s]


def run(model_dir: str, tokens: int, settings: list[str]) -> None:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from vllm.v1.attention.ops.ultraquant.reference import hadamard_matrix

    from vllm_kvcompress.tools.datasets import dataset_texts

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = torch.tensor([tok(dataset_texts("essays")[0][:20 * tokens]).input_ids[:tokens]])
    current: dict = {}

    def attention(module, query, key, value, attention_mask, **kw):
        spec = current.get("spec")
        if spec:
            rot = hadamard_matrix(key.shape[-1], key.device)
            k = key @ rot if spec["rotate"] in ("kv", "k") else key
            v = value @ rot if spec["rotate"] in ("kv", "v") else value
            k = fake_quant(k, spec["bits"], spec["k_axis"], spec["block"])
            v = fake_quant(v, spec["bits"], "token", 128)
            key = k @ rot.T if spec["rotate"] in ("kv", "k") else k
            value = v @ rot.T if spec["rotate"] in ("kv", "v") else v
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("fq", attention)
    model.config._attn_implementation = "fq"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "fq"
    base = None
    for name in ["16-bit"] + settings:
        current["spec"] = None if name == "16-bit" else _parse(name)
        with torch.no_grad():
            loss = model(ids, labels=ids).loss.item()
        ppl = math.exp(loss)
        base = base or ppl
        print(f"{name:28s} ppl {ppl:8.3f}  {100 * (ppl / base - 1):+6.2f}%", flush=True)


def _parse(name: str) -> dict:
    """BITS-AXIS[BLOCK][-rotK|-rotV|-rotKV]: '4-channel', '4-channel64-rotV', '4-token-rotKV'."""
    parts = name.split("-")
    axis = parts[1].rstrip("0123456789")
    block = int(parts[1][len(axis):] or 128)
    rotate = parts[2][3:].lower() if len(parts) > 2 else ""
    return {"bits": int(parts[0]), "k_axis": axis, "block": block, "rotate": rotate}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--settings", nargs="+", default=["4-channel", "4-token", "4-token-rotKV", "4-channel-rotKV",
                                                       "4-channel-rotV", "2-channel", "2-channel-rotV"])
    args = ap.parse_args()
    run(args.model, args.tokens, args.settings)
