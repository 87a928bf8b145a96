"""``kvcompress slim-weights MODEL -o FILE``: precompute slim attention's W_KV offline.

Reads each layer's K and V projection weights straight from the checkpoint's
safetensors (no model is built), inverts W_K in float64 and writes W_KV and
cond(W_K) per layer. A config with ``slim_weights: FILE`` then skips the
inversion at startup.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from ..slim import max_amplification, save_weights, w_kv_from_projections

_K_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.k_proj\.weight$")


def projection_weights(model_dir: Path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (W_k, W_v)} from ``model.layers.N.self_attn.{k,v}_proj.weight`` in the safetensors files."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"error: no *.safetensors files in {model_dir}")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(f, "pt") as st:
            names.update({k: f for k in st.keys()})
    found = {}
    for name, f in names.items():
        match = _K_NAME.match(name)
        if match:
            v_name = name.replace("k_proj", "v_proj")
            with safe_open(f, "pt") as st_k, safe_open(names[v_name], "pt") as st_v:
                found[int(match.group(1))] = (st_k.get_tensor(name), st_v.get_tensor(v_name))
    if not found:
        raise SystemExit(f"error: {model_dir} has no separate self_attn.k_proj/v_proj weights to invert")
    return found


def main(argv: list[str]) -> int:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(prog="kvcompress slim-weights", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="Hugging Face model folder (safetensors)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="file to write (torch format)")
    args = parser.parse_args(argv)
    weights = projection_weights(args.model)
    w_kv, cond = {}, {}
    for layer in tqdm(sorted(weights), desc="inverting W_K", unit="layer"):
        w_k, w_v = weights[layer]
        if w_k.shape[0] != w_k.shape[1]:
            raise SystemExit(f"error: layer {layer}: W_K is {tuple(w_k.shape)}, not square "
                             "(slim attention needs multi-head attention)")
        full, cond[layer] = w_kv_from_projections(w_k, w_v)
        if full is not None:
            w_kv[layer] = full.to(w_k.dtype)
    save_weights(args.output, w_kv, cond, str(args.model))
    limit = max_amplification(16, next(iter(weights.values()))[0].dtype)
    print(json.dumps({"output": str(args.output), "layers": len(w_kv),
                      "max_cond": max(c.cond for c in cond.values()),
                      "max_amplification": max(c.amplification for c in cond.values()),
                      "limit_for_16_bit_k": limit,
                      "over_limit": [i for i, c in cond.items() if not c.amplification < limit]}))
    return 0
