"""``kvcompress profile MODEL -o configs/NAME.yaml``: KVmix's offline per-layer bit profile.

KVmix gives each layer's K and V their own bit-width from the importance of that layer's
key and value projections: the L2 (Frobenius) norm of the loss gradient with respect to
W_k and W_v, averaged over a few dozen prompts. The most important share of layers
(20% by default, K and V ranked separately) gets 3 or 4 bits, the rest 2.

Pieces, each usable on its own:

- :func:`~.datasets.sample_prompts`: a seeded sample of texts from GSM8K or ShareGPT (pip packages);
  :func:`~.datasets.read_prompts`: the user's own prompts file instead (``--prompts FILE``);
- :func:`locate_kv_weights`: each attention layer's W_k and W_v in a transformers model,
  separate ``k_proj``/``v_proj`` or sliced out of a fused projection;
- :func:`gradient_scores`: the per-layer, per-prompt gradient norms;
- :func:`rank_layers`, :func:`build_config`: the ranking and the ``--kv-compression`` config;
- :func:`write_outputs`: ``NAME.yaml``, ``NAME.scores.json`` and (with matplotlib) ``NAME.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .datasets import DATASETS, PROMPTS_FORMAT, MissingDataset, read_prompts, sample_prompts

LOW_BITS = 2
HIGH_BITS_ALLOWED = (3, 4)


# ---------------------------------------------------------------------------------------------
# where W_k and W_v are


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int

    def identity(self) -> dict:
        """The ``model:`` section of a config (what vLLM reports for the served model)."""
        return {"architecture": self.architecture, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_size": self.head_size}


def model_shape(model) -> ModelShape:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None)
    if text.model_type == "falcon":
        kv = text.num_kv_heads if text.new_decoder_architecture else (1 if text.multi_query else heads)
    elif kv is None:
        kv = 1 if getattr(text, "multi_query", False) else heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
    architecture = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    return ModelShape(architecture, text.model_type, text.num_hidden_layers, heads, kv, head_size)


@dataclass
class KVWeights:
    """One attention layer's W_k and W_v: separate weights, or rows of one fused weight.

    ``k_index``/``v_index`` are output-feature indices into the fused weight (``None`` for
    separate weights); ``axis`` is where output features lie (0 for ``nn.Linear``, 1 for
    GPT-2's ``Conv1D``)."""

    name: str
    k: torch.nn.Parameter
    v: torch.nn.Parameter | None = None
    k_index: torch.Tensor | None = None
    v_index: torch.Tensor | None = None
    axis: int = 0

    @property
    def fused(self) -> bool:
        return self.v is None

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.k] if self.fused else [self.k, self.v]

    def grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(dL/dW_k, dL/dW_v), each shaped like the projection's own weight."""
        if not self.fused:
            return self.k.grad, self.v.grad
        g = self.k.grad
        return g.index_select(self.axis, self.k_index), g.index_select(self.axis, self.v_index)


_SEPARATE = (("k_proj", "v_proj"),)
_FUSED_NAMES = ("qkv_proj", "c_attn", "query_key_value", "Wqkv")


def fused_kv_index(shape: ModelShape, attr: str, config, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Output-feature indices of K and V inside a fused QKV projection of this architecture.

    Layouts: ``contiguous`` = [Q heads | K heads | V heads]; ``per_head`` = per head [q | k | v]
    (GPT-NeoX, Bloom, GPT-BigCode without multi-query, Falcon-7B-style); ``grouped`` = per KV head
    [its queries | k | v] (Falcon's new decoder architecture)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, kv, d, mt = shape.num_heads, shape.num_kv_heads, shape.head_size, shape.model_type
    if attr in ("qkv_proj", "Wqkv") and mt not in ("codegen",):
        layout = "contiguous"
    elif attr == "c_attn" and mt == "gpt2":
        layout = "contiguous"
    elif attr == "c_attn" and mt == "gpt_bigcode":
        layout = "contiguous" if text.multi_query else "per_head"
    elif attr == "query_key_value" and mt in ("gpt_neox", "bloom"):
        layout = "per_head"
    elif attr == "query_key_value" and mt == "falcon":
        layout = "grouped" if text.new_decoder_architecture else ("contiguous" if text.multi_query else "per_head")
    else:
        raise SystemExit(f"error: fused projection '{attr}' of model type '{mt}': its Q/K/V row layout is not "
                         f"known to the profiler (known: qkv_proj/Wqkv, gpt2 and gpt_bigcode c_attn, "
                         f"gpt_neox/bloom/falcon query_key_value)")
    ar = torch.arange(d)
    if layout == "contiguous":
        k = h * d + torch.arange(kv * d)
        v = (h + kv) * d + torch.arange(kv * d)
    elif layout == "per_head":
        k = torch.cat([i * 3 * d + d + ar for i in range(h)])
        v = torch.cat([i * 3 * d + 2 * d + ar for i in range(h)])
    else:
        g = h // kv
        k = torch.cat([i * (g + 2) * d + g * d + ar for i in range(kv)])
        v = torch.cat([i * (g + 2) * d + (g + 1) * d + ar for i in range(kv)])
    if out_features != (h + 2 * kv) * d:
        raise SystemExit(f"error: fused projection '{attr}' has {out_features} outputs, expected "
                         f"(heads {h} + 2 x KV heads {kv}) x head size {d} = {(h + 2 * kv) * d}")
    return k, v


def locate_kv_weights(model) -> list[KVWeights]:
    """Each attention layer's W_k and W_v, in layer order."""
    shape = model_shape(model)
    found: list[KVWeights] = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        for k_attr, v_attr in _SEPARATE:
            if k_attr in children and v_attr in children:
                found.append(KVWeights(name, children[k_attr].weight, children[v_attr].weight))
                break
        else:
            for attr in _FUSED_NAMES:
                if attr in children and hasattr(children[attr], "weight"):
                    proj = children[attr]
                    # nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out]
                    axis = 1 if type(proj).__name__ == "Conv1D" else 0
                    k_idx, v_idx = fused_kv_index(shape, attr, model.config, proj.weight.shape[axis])
                    found.append(KVWeights(f"{name}.{attr}", proj.weight, None, k_idx, v_idx, axis))
                    break
    if len(found) > shape.num_layers:  # e.g. a vision tower beside the language model
        found = [f for f in found if not any(w in f.name for w in ("vision", "visual", "image", "audio"))]
    if len(found) != shape.num_layers:
        names = ", ".join(f.name for f in found[:4]) or "none"
        raise SystemExit(f"error: found {len(found)} attention layers with K/V projections ({names}...), but the "
                         f"model config says {shape.num_layers} layers: the profiler does not know this model's layout")
    return found


# ---------------------------------------------------------------------------------------------
# scores


@dataclass
class Scores:
    """Per prompt (rows) and layer (columns): ||dL/dW_k||_F and ||dL/dW_v||_F."""

    k: torch.Tensor
    v: torch.Tensor
    tokens: list[int] = field(default_factory=list)

    @property
    def k_mean(self) -> torch.Tensor:
        return self.k.mean(0)

    @property
    def v_mean(self) -> torch.Tensor:
        return self.v.mean(0)


def load_model(model_dir: str | Path, device: str = "auto"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    return model, tok


def gradient_scores(model, tokenizer, texts: list[str], max_tokens: int = 512, progress: bool = True,
                    source: str = "the given texts") -> Scores:
    """Gradient norms of the language-model loss (mean over all tokens of a text) w.r.t. each
    layer's W_k and W_v, one row per text. Only those weights get gradients. ``source`` names
    the texts in the error for one too short."""
    from tqdm import tqdm

    weights = locate_kv_weights(model)
    model.eval()  # no dropout: the scores are a deterministic function of the texts
    model.requires_grad_(False)
    for w in weights:
        for p in w.parameters():
            p.requires_grad_(True)
    device = next(model.parameters()).device
    k_rows, v_rows, tokens = [], [], []
    for number, text in enumerate(tqdm(texts, desc="profiling", unit="prompt", disable=not progress,
                                       file=sys.stderr), 1):
        ids = tokenizer(text, truncation=True, max_length=max_tokens, return_tensors="pt").input_ids.to(device)
        if ids.shape[1] < 2:
            raise SystemExit(f"error: prompt {number} of {source} ({text[:60]!r}) has {ids.shape[1]} token(s); "
                             f"the next-token loss needs at least 2")
        for w in weights:
            for p in w.parameters():
                p.grad = None
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        k_norms, v_norms = [], []
        for w in weights:
            gk, gv = w.grads()
            k_norms.append(torch.linalg.vector_norm(gk.double()).item())
            v_norms.append(torch.linalg.vector_norm(gv.double()).item())
        k_rows.append(k_norms)
        v_rows.append(v_norms)
        tokens.append(ids.shape[1])
    for w in weights:
        for p in w.parameters():
            p.grad = None
            p.requires_grad_(False)
    return Scores(torch.tensor(k_rows, dtype=torch.float64), torch.tensor(v_rows, dtype=torch.float64), tokens)


# ---------------------------------------------------------------------------------------------
# ranking and config


def num_high_layers(num_layers: int, fraction: float) -> int:
    """``fraction`` of the layers, rounded half up, at least one (0 only for fraction 0)."""
    if fraction <= 0:
        return 0
    return min(num_layers, max(1, math.floor(fraction * num_layers + 0.5)))


def rank_layers(scores: torch.Tensor) -> list[int]:
    """Rank of each layer (0 = largest score; ties go to the lower layer index)."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    ranks = [0] * len(scores)
    for r, i in enumerate(order):
        ranks[i] = r
    return ranks


@dataclass
class Plan:
    k_bits: list[int]
    v_bits: list[int]
    k_ranks: list[int]
    v_ranks: list[int]
    num_high: int

    @property
    def avg_k_bits(self) -> float:
        return sum(self.k_bits) / len(self.k_bits)

    @property
    def avg_v_bits(self) -> float:
        return sum(self.v_bits) / len(self.v_bits)

    def high_layers(self, which: str) -> list[int]:
        """High-bit layers, most important first."""
        bits, ranks = (self.k_bits, self.k_ranks) if which == "k" else (self.v_bits, self.v_ranks)
        return sorted((i for i, b in enumerate(bits) if b != LOW_BITS), key=lambda i: ranks[i])


def plan_bits(scores: Scores, high_fraction: float = 0.2, high_k_bits: int = 4, high_v_bits: int = 4) -> Plan:
    for flag, bits in (("--high-k-bits", high_k_bits), ("--high-v-bits", high_v_bits)):
        if bits not in HIGH_BITS_ALLOWED:
            raise SystemExit(f"error: {flag} {bits} is not allowed; allowed: 3, 4")
    if not 0 <= high_fraction <= 1:
        raise SystemExit(f"error: --high-fraction {high_fraction} must lie in 0..1")
    n = scores.k.shape[1]
    num_high = num_high_layers(n, high_fraction)
    k_ranks, v_ranks = rank_layers(scores.k_mean), rank_layers(scores.v_mean)
    return Plan([high_k_bits if r < num_high else LOW_BITS for r in k_ranks],
                [high_v_bits if r < num_high else LOW_BITS for r in v_ranks], k_ranks, v_ranks, num_high)


def build_config(plan: Plan, name: str, description: str, identity: dict, rpc_tokens: int = 0,
                 rpc_high: float = 0.2, rpc_low: float = 0.1) -> dict:
    """The ``--kv-compression`` config: 2-bit default, overrides where a layer's K or V is high.

    With ``rpc_tokens > 0`` every layer keeps a recent window at 16 bits (KVmix's RPC):
    ``rpc_low`` of the newest tokens, ``rpc_high`` for layers with a high-bit K or V."""
    default: dict = {"k_bits": LOW_BITS, "v_bits": LOW_BITS}
    if rpc_tokens > 0:
        default |= {"rpc_fraction": rpc_low, "rpc_tokens": rpc_tokens}
    layers = {}
    for i, (kb, vb) in enumerate(zip(plan.k_bits, plan.v_bits)):
        override: dict = {}
        if kb != LOW_BITS:
            override["k_bits"] = kb
        if vb != LOW_BITS:
            override["v_bits"] = vb
        if override and rpc_tokens > 0 and rpc_high != rpc_low:
            override["rpc_fraction"] = rpc_high
        if override:
            layers[i] = override
    return {"name": name, "description": description, "model": identity, "default": default, "layers": layers}


# ---------------------------------------------------------------------------------------------
# files


def _flow(data) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in data.items()) + "}"


def config_yaml(config: dict) -> str:
    """YAML with one line per layer override (as the hand-written configs look)."""
    import yaml

    head = yaml.safe_dump({k: config[k] for k in ("name", "description")}, sort_keys=False, width=1000)
    lines = [head.rstrip("\n"), f"model: {_flow(config['model'])}", f"default: {_flow(config['default'])}"]
    if config["layers"]:
        lines.append("layers:")
        lines += [f"  {i}: {_flow(o)}" for i, o in sorted(config["layers"].items())]
    else:
        lines.append("layers: {}")
    return "\n".join(lines) + "\n"


def plot_scores(path: Path, scores: Scores, plan: Plan, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = scores.k.shape[1]
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.3 * n + 2), 6), sharex=True)
    for ax, which, mean, bits in ((axes[0], "K", scores.k_mean, plan.k_bits), (axes[1], "V", scores.v_mean, plan.v_bits)):
        colors = ["tab:red" if b != LOW_BITS else "tab:blue" for b in bits]
        ax.bar(range(n), mean.tolist(), color=colors)
        high = max(bits)
        ax.set_ylabel(f"{which}: mean ||dL/dW_{which.lower()}||")
        ax.set_title(f"{which}: red = {high} bits ({sum(b != LOW_BITS for b in bits)} layers), blue = {LOW_BITS} bits",
                     fontsize=9)
    axes[1].set_xlabel("layer")
    axes[1].set_xticks(range(n))
    axes[1].tick_params(axis="x", labelsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(output: Path, config: dict, scores: Scores, plan: Plan, metadata: dict,
                  plot: bool = True) -> dict[str, Path]:
    """``NAME.yaml``, ``NAME.scores.json`` and (with matplotlib) ``NAME.png`` next to each other."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    stem = output.with_suffix("")
    paths = {"config": output, "scores": stem.with_suffix(".scores.json"), "plot": stem.with_suffix(".png")}
    paths["config"].write_text(config_yaml(config))
    layers = [{"layer": i, "k_score": float(scores.k_mean[i]), "v_score": float(scores.v_mean[i]),
               "k_std": float(scores.k[:, i].std(unbiased=False)), "v_std": float(scores.v[:, i].std(unbiased=False)),
               "k_rank": plan.k_ranks[i], "v_rank": plan.v_ranks[i], "k_bits": plan.k_bits[i], "v_bits": plan.v_bits[i]}
              for i in range(len(plan.k_bits))]
    data = {**metadata, "num_high_layers": plan.num_high, "high_layers_k": plan.high_layers("k"),
            "high_layers_v": plan.high_layers("v"), "avg_k_bits": plan.avg_k_bits, "avg_v_bits": plan.avg_v_bits,
            "prompt_tokens": scores.tokens, "layers": layers}
    paths["scores"].write_text(json.dumps(data, indent=1) + "\n")
    try:
        if plot:
            plot_scores(paths["plot"], scores, plan, f"{config['name']}: gradient-norm importance, {metadata['model']}")
    except ImportError as err:  # matplotlib is optional: the config and scores are the result
        print(f"note: no plot {paths['plot']} ({err}; pip install matplotlib); wrote the config and scores",
              file=sys.stderr)
        plot = False
    if not plot:
        del paths["plot"]
    return paths


# ---------------------------------------------------------------------------------------------
# the whole job


def dataset_prompts(dataset: str, num_prompts: int, seed: int) -> list[str]:
    """:func:`~.datasets.sample_prompts`, whose missing-package error also offers ``--prompts FILE``."""
    try:
        return sample_prompts(dataset, num_prompts, seed)
    except MissingDataset as err:
        raise SystemExit(f"{err}, or profile on your own prompts with --prompts FILE") from None


def profile(model_dir: str | Path, output: str | Path, texts: list[str] | None = None, dataset: str = "gsm8k",
            num_prompts: int = 24, seed: int = 0, max_tokens: int = 512, high_fraction: float = 0.2,
            high_k_bits: int = 4, high_v_bits: int = 4, rpc_tokens: int = 0, rpc_high: float = 0.2,
            rpc_low: float = 0.1, name: str | None = None, device: str = "auto", progress: bool = True,
            plot: bool = True, prompts: str | Path | None = None) -> dict:
    """Profile ``model_dir`` and write the config, scores and plot. ``texts``, else every prompt of the
    file ``prompts``, replaces the dataset sample."""
    start = time.perf_counter()
    output = Path(output)
    name = name or output.with_suffix("").name
    if texts is not None:
        source = where = "given texts"
    elif prompts is not None:
        texts, source, where = read_prompts(prompts), str(prompts), f"--prompts {prompts}"
    else:
        texts, source, where = dataset_prompts(dataset, num_prompts, seed), dataset, f"--dataset {dataset}"
    torch.manual_seed(seed)
    model, tok = load_model(model_dir, device)
    shape = model_shape(model)
    weights = locate_kv_weights(model)
    scores = gradient_scores(model, tok, texts, max_tokens, progress, where)
    plan = plan_bits(scores, high_fraction, high_k_bits, high_v_bits)
    model_name = Path(model_dir).name
    description = (f"KVmix per-layer bits profiled from {model_name} on {len(texts)} prompts of {source} "
                   f"(seed {seed}, <= {max_tokens} tokens): top {plan.num_high} of {shape.num_layers} layers at "
                   f"K{high_k_bits}/V{high_v_bits} by gradient norm, the rest at 2 bits; average "
                   f"K {plan.avg_k_bits:.2f} / V {plan.avg_v_bits:.2f} bits")
    config = build_config(plan, name, description, shape.identity(), rpc_tokens, rpc_high, rpc_low)
    runtime = time.perf_counter() - start
    import transformers
    metadata = {"model": model_name, "model_path": str(model_dir), "identity": shape.identity(),
                "dataset": source, "num_prompts": len(texts), "seed": seed, "max_tokens": max_tokens,
                "high_fraction": high_fraction, "high_k_bits": high_k_bits, "high_v_bits": high_v_bits,
                "rpc_tokens": rpc_tokens, "loss": "mean token cross-entropy over all tokens of each prompt",
                "score": "mean over prompts of the Frobenius norm of dL/dW (K and V ranked separately)",
                "weights": {"k": weights[0].name + (" (fused, K rows)" if weights[0].fused else ".k_proj"),
                            "v": weights[0].name + (" (fused, V rows)" if weights[0].fused else ".v_proj")},
                "device": str(next(model.parameters()).device), "runtime_s": round(runtime, 1),
                "torch": torch.__version__, "transformers": transformers.__version__}
    paths = write_outputs(output, config, scores, plan, metadata, plot)
    return {"paths": paths, "config": config, "scores": scores, "plan": plan, "runtime_s": runtime}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcompress profile", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="Hugging Face model folder")
    parser.add_argument("-o", "--output", type=Path, required=True, help="config to write, e.g. configs/NAME.yaml "
                        "(NAME.scores.json and, with matplotlib, NAME.png go next to it)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", choices=DATASETS, default="gsm8k",
                        help="sample the prompts from this dataset's pip package (default: gsm8k)")
    source.add_argument("--prompts", type=Path, metavar="FILE",
                        help=f"profile on every prompt of your own FILE instead, no package needed: {PROMPTS_FORMAT}")
    parser.add_argument("--num-prompts", type=int, default=None, help="how many to sample from --dataset (default 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=512, help="truncate each prompt to this many tokens")
    parser.add_argument("--high-fraction", type=float, default=0.2,
                        help="share of layers at high bits, K and V ranked separately (rounded, at least 1)")
    parser.add_argument("--high-k-bits", type=int, default=4, choices=HIGH_BITS_ALLOWED)
    parser.add_argument("--high-v-bits", type=int, default=4, choices=HIGH_BITS_ALLOWED)
    parser.add_argument("--rpc-tokens", type=int, default=0,
                        help="with N > 0: a 16-bit recent window capped at N tokens on every layer")
    parser.add_argument("--rpc-high-fraction", type=float, default=0.2, help="window share on high-bit layers")
    parser.add_argument("--rpc-low-fraction", type=float, default=0.1, help="window share on the other layers")
    parser.add_argument("--name", default=None, help="config name (default: the output file's stem)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--no-plot", action="store_true",
                        help="skip the PNG (without matplotlib it is skipped anyway, with a note)")
    args = parser.parse_args(argv)
    if args.prompts is not None and args.num_prompts is not None:
        parser.error(f"--num-prompts {args.num_prompts} samples --dataset; --prompts uses every prompt of its file")
    num_prompts = 24 if args.num_prompts is None else args.num_prompts
    if num_prompts < 1:
        parser.error(f"--num-prompts {num_prompts} is not allowed; it must be at least 1")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")
    if args.rpc_tokens < 0:
        parser.error("--rpc-tokens must be 0 (off) or positive")
    result = profile(args.model, args.output, dataset=args.dataset, num_prompts=num_prompts, seed=args.seed,
                     max_tokens=args.max_tokens, high_fraction=args.high_fraction, high_k_bits=args.high_k_bits,
                     high_v_bits=args.high_v_bits, rpc_tokens=args.rpc_tokens, rpc_high=args.rpc_high_fraction,
                     rpc_low=args.rpc_low_fraction, name=args.name, device=args.device, plot=not args.no_plot,
                     prompts=args.prompts)
    plan: Plan = result["plan"]
    from ..config import load_config
    load_config(str(result["paths"]["config"]))  # what we wrote must load
    print(json.dumps({**{k: str(p) for k, p in result["paths"].items()},
                      "runtime_s": round(result["runtime_s"], 1), "avg_k_bits": round(plan.avg_k_bits, 3),
                      "avg_v_bits": round(plan.avg_v_bits, 3), "high_layers_k": plan.high_layers("k"),
                      "high_layers_v": plan.high_layers("v")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
