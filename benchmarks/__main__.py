"""One entry point for the benchmarks; each run writes a dated folder under ``--out``
(results.json, table.md, a PNG plot, logs):

    python -m benchmarks throughput [--small]   vllm bench throughput on ShareGPT per KV setting
    python -m benchmarks serve [--small]        vllm bench serve against our server, per setting and rate
    python -m benchmarks kernels [--small]      the GPU decode-kernel benchmark (benchmarks/kernels.py)
    python -m benchmarks quality [--small]      perplexity, KL, greedy, needles, GSM8K, HumanEval on real weights
    python -m benchmarks kvmix [--small]        KVmix profiled bits vs uniform 2-bit vs random high-bit layers
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from . import report, settings

BENCHES = ("throughput", "serve", "kernels", "quality", "kvmix")
DEFAULT_SETTINGS = {
    "throughput": ["auto", "fp8", "int4_per_token_head", "quant-k8v8", "quant-k4v4", "quant-k2v2"],
    "serve": ["auto", "fp8", "quant-k8v8", "quant-k4v4", "quant-k2v2"],
    "quality": ["auto", "fp8", "int4_per_token_head", "quant-k8v8", "quant-k4v4", "quant-k2v2", "zipcache-r50",
                "configs/kvmix-smollm2.yaml", "quant-k3v3"],
}
SMALL_SETTINGS = ["auto", "quant-k4v4"]


def _parser() -> argparse.ArgumentParser:
    from .quality import TEXTS

    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("bench", choices=BENCHES)
    p.add_argument("--small", action="store_true", help="a few prompts and settings: minutes on a CPU")
    p.add_argument("--model", default="smollm2",
                   help="smollm2, gemma3, qwen-coder (real weights from their pip packages), llama2-7b, llama3-8b "
                        "(dummy weights; throughput/serve), or a Hugging Face model folder")
    p.add_argument("--settings", nargs="+", default=None,
                   help="KV settings: auto, fp8, int4_per_token_head (vLLM's) or our configs (preset or YAML)")
    p.add_argument("--out", type=Path, default=Path("results"), help="the dated result folder goes here")
    p.add_argument("--models-dir", type=Path, default=Path("models"), help="where converted models are kept")
    p.add_argument("--kv-bytes", type=int, default=None, help="--kv-cache-memory-bytes for every setting")
    p.add_argument("--dtype", default=None, help="model dtype (quality, kvmix); default float32 on CPU, auto on GPU")
    p.add_argument("--num-prompts", type=int, default=None, help="ShareGPT prompts (throughput, serve)")
    p.add_argument("--max-model-len", type=int, default=None, help="throughput, serve")
    p.add_argument("--output-len", type=int, default=None, help="fixed output tokens per request (throughput, serve)")
    p.add_argument("--rates", type=float, nargs="+", default=None, help="request rates per second (serve)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per vLLM command (throughput, serve)")
    p.add_argument("--needles", nargs="+", default=None, metavar="LENGTH:COUNT",
                   help="needle prompts per length (quality), e.g. 1024:4 2048:2")
    p.add_argument("--greedy-prompts", type=int, default=None, help="prompts of the greedy comparison (quality)")
    p.add_argument("--chunk", type=int, default=None,
                   help="prompt chunks of at most N tokens; earlier context is read from the pages "
                        "(quality, kvmix; default 256, 64 with --small)"),
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens a KV block, vLLM's --block-size (quality, kvmix); default: 128 for our configs")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="perplexity at these contexts (quality)")
    p.add_argument("--ppl-windows", type=int, default=None,
                   help="essay windows of the longest context that perplexity and KL are taken over (quality)")
    p.add_argument("--gsm8k-questions", type=int, default=None, help="questions of the 16-bit GSM8K check (quality)")
    p.add_argument("--humaneval", type=int, default=0, metavar="N",
                   help="HumanEval pass@1 on its first N problems (of 164), every setting "
                        "(quality; default 0: not run)")
    p.add_argument("--text", choices=tuple(TEXTS), default="essays",
                   help="perplexity windows and greedy prompts from Paul Graham's essays or HumanEval's Python "
                        "problems with their solutions; needles stay in the essays (quality)")
    p.add_argument("--config", type=Path, default=Path("configs/kvmix-smollm2.yaml"), help="profiled config (kvmix)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="random baselines (kvmix)")
    p.add_argument("--rpc-tokens", type=int, default=32, help="recent window for the RPC variants, 0: none (kvmix)")
    return p


def _needle_arg(text: str) -> tuple[int, int]:
    length, _, count = text.partition(":")
    if not (length.isdigit() and count.isdigit() and int(count) > 0):
        raise SystemExit(f"error: --needles {text!r}: expected LENGTH:COUNT with positive integers, e.g. 1024:4")
    return int(length), int(count)


def _kernels(rest: list[str], small: bool) -> int:
    import torch

    if not torch.cuda.is_available():
        if small:
            print("kernels: skipped, the decode-kernel benchmark needs a CUDA GPU and none is visible")
            return 0
        print("error: kernels: the decode-kernel benchmark needs a CUDA GPU and none is visible", file=sys.stderr)
        return 2
    from . import kernels

    sys.argv = ["python -m benchmarks kernels", *(["--batch", "8", "--ctx", "1024"] if small else []), *rest]
    kernels.main()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kernels"]:  # everything after it belongs to benchmarks/kernels.py
        rest = [a for a in argv[1:] if a != "--small"]
        return _kernels(rest, "--small" in argv[1:])
    args = _parser().parse_args(argv)
    if args.kv_bytes is not None and args.kv_bytes <= 0:
        raise SystemExit(f"error: --kv-bytes {args.kv_bytes} must be a positive number of bytes")
    sizes = _quality_sizes(args)  # checked before anything is converted or written
    from .models import prepare

    model = prepare(args.model, args.models_dir)
    kv_settings = args.settings or (SMALL_SETTINGS if args.small else DEFAULT_SETTINGS.get(args.bench, []))
    out = report.results_dir(args.bench, args.out)
    what = f"config {args.config}" if args.bench == "kvmix" else f"settings {' '.join(kv_settings)}"
    print(f"{args.bench}: {model.name}, {what}; results in {out}", flush=True)
    if args.bench in ("throughput", "serve"):
        return _vllm_bench(args, model, kv_settings, out)
    from . import kvmix, quality

    dtype = args.dtype or ("auto" if settings.on_gpu() else "float32")
    kv_bytes = args.kv_bytes or (64 << 20 if args.small else 512 << 20)
    if args.bench == "quality":
        result = quality.run(model, kv_settings, sizes, out, dtype, kv_bytes, text=args.text)
    else:
        seeds = args.seeds or ([0, 1] if args.small else [0, 1, 2, 3])
        result = kvmix.run(model, args.config, seeds, args.rpc_tokens, sizes, out, dtype, kv_bytes)
    print((out / "table.md").read_text())
    return 1 if all("error" in r for r in result["rows"]) else 0


def _quality_sizes(args):
    """How much text each quality measurement uses (quality, kvmix)."""
    from . import quality

    if args.chunk is not None and args.chunk < 16:
        raise SystemExit(f"error: --chunk {args.chunk} is not allowed; allowed: 16 tokens or more")
    if args.block_size is not None and (args.block_size <= 0 or args.block_size % 16):
        raise SystemExit(f"error: --block-size {args.block_size} is not allowed; allowed: a multiple of 16")
    base = quality.SMALL if args.small else quality.FULL
    chunk = base.chunk if args.chunk is None else args.chunk
    if args.bench == "kvmix":  # perplexity only: windows of 2048 tokens (256 with --small)
        return quality.Sizes(contexts=(256,) if args.small else (2048,), ppl_windows=1 if args.small else 2,
                             needle=(), chunk=chunk, block_size=args.block_size)
    sizes = dataclasses.replace(base, chunk=chunk, block_size=args.block_size)
    if args.contexts:
        sizes = dataclasses.replace(sizes, contexts=tuple(sorted(args.contexts)))
    for flag, value, least in (("--greedy-prompts", args.greedy_prompts, 1), ("--ppl-windows", args.ppl_windows, 1),
                               ("--gsm8k-questions", args.gsm8k_questions, 0)):
        if value is not None and value < least:
            raise SystemExit(f"error: {flag} {value} is not allowed; allowed: {least} or more")
    if args.needles:
        sizes = dataclasses.replace(sizes, needle=tuple(_needle_arg(a) for a in args.needles))
    if args.ppl_windows is not None:
        sizes = dataclasses.replace(sizes, ppl_windows=args.ppl_windows)
    if args.greedy_prompts is not None:
        sizes = dataclasses.replace(sizes, greedy_prompts=args.greedy_prompts)
    if args.gsm8k_questions is not None:
        sizes = dataclasses.replace(sizes, gsm8k=args.gsm8k_questions)
    if args.humaneval:
        from .humaneval import problems

        total = len(problems())
        if not 0 < args.humaneval <= total:
            raise SystemExit(f"error: --humaneval {args.humaneval} is not allowed; allowed: 0 to {total}")
        sizes = dataclasses.replace(sizes, humaneval=args.humaneval)
    return sizes


def _vllm_bench(args, model, kv_settings: list[str], out: Path) -> int:
    from . import serve, sharegpt, throughput

    num_prompts = args.num_prompts or (8 if args.small else 1000 if args.bench == "throughput" else 200)
    dataset = sharegpt.write_for_vllm(out / "sharegpt.json", sample=max(num_prompts * 4, 100))
    kv_bytes = args.kv_bytes or (64 << 20 if args.small else 1 << 30)
    max_len = args.max_model_len or (2048 if args.small else 4096)
    output_len = args.output_len or (16 if args.small else None)
    eager = not settings.on_gpu()
    if args.bench == "throughput":
        rows = throughput.run(model, kv_settings, dataset, out, num_prompts, kv_bytes, max_len, output_len, eager,
                              args.timeout)
        report.write(out, {"bench": "throughput", "model": model.name, "device": report.device(),
                           "kv_cache_memory_bytes": kv_bytes, "num_prompts": num_prompts, "rows": rows},
                     throughput.table(rows))
        throughput.plot(rows, out / "throughput.png", f"{model.name}, {report.device()}")
    else:
        rates = args.rates or ([1.0, 4.0] if args.small else [1.0, 2.0, 4.0, 8.0])
        rows = serve.run(model, kv_settings, rates, dataset, out, num_prompts, kv_bytes, max_len, output_len, eager,
                         args.timeout)
        report.write(out, {"bench": "serve", "model": model.name, "device": report.device(),
                           "kv_cache_memory_bytes": kv_bytes, "num_prompts": num_prompts, "rows": rows},
                     serve.table(rows))
        serve.plot(rows, out / "serve.png", f"{model.name}, {report.device()}")
    print((out / "table.md").read_text())
    return 1 if all("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
