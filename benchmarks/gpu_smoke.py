"""End-to-end check on the GPU: a small Llama through vLLM, stock vs compressed.

Greedy tokens and prompt logprobs against stock vLLM (bf16), with CUDA graphs
and torch.compile on (vLLM's defaults) and with --enforce-eager.

    PYTHONPATH=tests python benchmarks/gpu_smoke.py --out results/gpu_smoke.json

``tests/`` has the tiny model. Run by path, the checkout root stays off ``sys.path`` (see
benchmarks/vllm_cli.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def run(model: str, setting, eager: bool, prompts, torch_path: bool = False) -> dict:
    import os

    import torch
    from vllm import LLM, SamplingParams

    from vllm_kvcompress import policy

    extra = {"additional_config": {"kv_compression": setting}} if setting else {}
    if torch_path:
        os.environ["KVCOMPRESS_KERNELS"] = "torch"
    else:
        os.environ.pop("KVCOMPRESS_KERNELS", None)
    policy.current.cache_clear()  # this process reads the switches once; the engine's processes anew
    llm = LLM(model, dtype="bfloat16", kv_cache_memory_bytes=1 << 30, enforce_eager=eager,
              max_model_len=2048, seed=0, **extra)
    t = time.time()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    gen_s = time.time() - t
    lp = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    cc = llm.llm_engine.vllm_config.cache_config
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[d[o.prompt_token_ids[i]].logprob for i, d in enumerate(o.prompt_logprobs) if i]
                     for o in lp],
        "kv_tokens": cc.num_gpu_blocks * cc.block_size, "generate_s": gen_s,
    }
    llm.llm_engine.engine_core.shutdown()
    del llm
    torch.cuda.empty_cache()
    return result


def main() -> None:
    import os

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # a forked engine fails once CUDA is up here
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare-only", action="store_true", help="only Triton kernels vs the torch path")
    ap.add_argument("--compare", nargs="+", default=["quant-k4v4", "quant-k2v2"],
                    help="settings whose Triton path is compared with the torch path")
    ap.add_argument("--rows", nargs="+", default=None, metavar="NAME",
                    help="only these comparisons with stock vLLM (by name: quant-k8v8, quant-k4v4, quant-k2v2, "
                         "'k8v8, V turned')")
    ap.add_argument("--mha", action="store_true",
                    help="a model with one query head a KV head (whose 4/4 decode rows go to the CUDA kernel)")
    ap.add_argument("--sliding-window", type=int, default=None, metavar="N",
                    help="every other layer attends to its newest N tokens only (as Gemma 3's sliding layers)")
    args = ap.parse_args()
    from engine_utils import prose
    from tiny_models import build_llama

    model = build_llama(Path(tempfile.mkdtemp()) / "llama-d128", num_kv_heads=8 if args.mha else 2, num_heads=8,
                        hidden=1024, layers=4)
    if args.sliding_window:
        config = json.loads((model / "config.json").read_text())
        config.update(sliding_window=args.sliding_window, layer_types=["sliding_attention", "full_attention"] * 2)
        (model / "config.json").write_text(json.dumps(config))
    model = str(model)
    prompts = [prose(400, i) for i in range(6)] + ["The quick brown fox"]
    report = {}
    rotated = {"default": {"k_bits": 8, "v_bits": 8, "v_rotation": True}}  # V's turn folded into bf16 weights
    settings = () if args.compare_only else (  # (name, setting, eager)
        ("quant-k8v8", "quant-k8v8", True), ("quant-k4v4", "quant-k4v4", True), ("quant-k4v4", "quant-k4v4", False),
        ("quant-k2v2", "quant-k2v2", True), ("k8v8, V turned", rotated, False))
    settings = [row for row in settings if args.rows is None or row[0] in args.rows]
    if settings:
        stock = run(model, None, True, prompts)
    for name, setting, eager in settings:
        r = run(model, setting, eager, prompts)
        same = sum(a == b for s, o in zip(stock["tokens"], r["tokens"]) for a, b in zip(s, o))
        dl = max(abs(a - b) for s, o in zip(stock["logprobs"], r["logprobs"]) for a, b in zip(s, o))
        key = f"{name} {'eager' if eager else 'graphs+compile'}"
        if r["kv_tokens"] <= stock["kv_tokens"]:
            raise SystemExit(f"{key}: compression is not active (is the plugin installed?)")
        report[key] = {"greedy_same": f"{same}/{32 * len(prompts)}", "max_logprob_diff_vs_stock": dl,
                       "kv_tokens_vs_stock": r["kv_tokens"] / stock["kv_tokens"], "generate_s": r["generate_s"]}
        print(key, report[key], flush=True)
    # our kernels (prefill as rows of prompt tokens; decode in full CUDA graphs; with --mha, 4/4 decode
    # rows in the CUDA kernel) against the backend's torch reference path, eager, on the same pages
    for setting in args.compare:
        ref = run(model, setting, True, prompts, torch_path=True)
        for eager in (False, True):
            tri = run(model, setting, eager, prompts)
            dl = max(abs(a - b) for s, o in zip(tri["logprobs"], ref["logprobs"]) for a, b in zip(s, o))
            same = sum(a == b for s, o in zip(tri["tokens"], ref["tokens"]) for a, b in zip(s, o))
            key = f"{setting} triton ({'eager' if eager else 'graphs+compile'}) vs torch reference (eager)"
            report[key] = {"max_prompt_logprob_diff": dl, "greedy_same": f"{same}/{32 * len(prompts)}",
                           "triton_generate_s": tri["generate_s"], "torch_generate_s": ref["generate_s"]}
            print(key, report[key], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
