"""What a busy server meets, on the CPU server through the plugin's pages: many concurrent clients on
a cache too small for them (preemption and recompute), prefix caching and chunked prefill together,
clients that leave mid-stream, requests that are the client's fault, and SIGTERM under load.

Each test runs on two servers: 16-bit pages (the plugin's backend storing the model's own values)
and quant-k4v4. At 16 bits every client must get the tokens stock vLLM gives it alone. 4-bit pages
depend on how a block's tokens arrived (a block encoded whole takes its own grid; tokens appended
to it widen the grid, docs/formats.md), and a shared prompt-token budget splits prompts where other
requests leave room, so under load a 4-bit answer can differ from the same request alone; the
16-bit run is the check that the paging itself (preemption, recompute, prefix hits) loses nothing."""

import concurrent.futures
import json
import re
import signal
import time

import pytest
import torch
from engine_utils import engine, greedy, prose
from server_utils import start_server
from tiny_models import build_llama

pytestmark = pytest.mark.engine

MAX_LEN = 512
SHARED = prose(120, seed=99)  # a long common prefix: prefix-cache hits under load
PROMPTS = ([prose(5 + (37 * i) % 230, seed=i) for i in range(48)]
           + [f"{SHARED} {prose(4 + i, seed=200 + i)}" for i in range(16)])
MAX_TOKENS = [8 + (11 * i) % 40 for i in range(len(PROMPTS))]
PAGES_16_BIT = "default: {k_bits: 16, v_bits: 16}\n"
# the plugin takes 16-bit models on CUDA; the CPU engine runs the test model in float32
DTYPE = "float16" if torch.cuda.is_available() else "float32"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("models") / "busy-gqa", num_kv_heads=2, num_heads=4)


@pytest.fixture(scope="module", params=["16-bit", "quant-k4v4"])
def busy_server(model, tmp_path_factory, request):
    """Room for about 2,000 tokens (64 requests want about 9,000), prompt chunks of at most 128
    tokens, prefix caching on."""
    folder = tmp_path_factory.mktemp("busy")
    log = folder / "server.log"
    if request.param == "16-bit":
        setting, kv_bytes = str(folder / "pages-16-bit.yaml"), 8 << 20
        (folder / "pages-16-bit.yaml").write_text(PAGES_16_BIT)
    else:
        setting, kv_bytes = request.param, 9 << 17
    proc, base = start_server(model, ["--kv-compression", setting, "--dtype", DTYPE, "--enforce-eager",
                                      "--max-model-len", str(MAX_LEN), "--kv-cache-memory-bytes", str(kv_bytes),
                                      "--max-num-batched-tokens", "128", "--max-num-seqs", "64",
                                      "--enable-prefix-caching", "--served-model-name", "tiny"], log)
    yield base, proc, log, request.param
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=60)


def _metric(base: str, name: str) -> float:
    import httpx
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
    assert values, f"/metrics has no {name}"
    return sum(values)


def _complete(base: str, prompt: str, max_tokens: int, stream: bool, timeout: float = 600) -> list[int]:
    """Greedy completion's token ids, streamed or not."""
    import httpx
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]
    ids: list[int] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                ids += chunk["choices"][0].get("token_ids") or []
    return ids


def _cache_drains(base: str) -> None:
    """vLLM's gauges: no request running or waiting and no KV block in use once the load is over."""
    deadline = time.time() + 60
    while time.time() < deadline:
        state = [_metric(base, "vllm:num_requests_running"), _metric(base, "vllm:num_requests_waiting"),
                 _metric(base, "vllm:kv_cache_usage_perc")]
        if state == [0, 0, 0]:
            return
        time.sleep(1)
    pytest.fail(f"after the load: running, waiting, KV usage = {state}")


def test_sixty_four_clients_on_a_small_cache(busy_server, model):
    """64 concurrent clients of mixed lengths, half streaming, on a cache of about a fifth of what
    they need: vLLM preempts and recomputes, prompts are served in chunks and from the prefix cache,
    every client gets all its tokens, and the cache is empty afterwards. At 16 bits each client's
    tokens are those stock vLLM gives it alone."""
    base, _, _, setting = busy_server
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        served = list(pool.map(lambda a: _complete(base, *a),
                               [(p, n, i % 2 == 0) for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))]))
    assert _metric(base, "vllm:num_preemptions_total") > 0, "the cache was not small enough to preempt"
    assert _metric(base, "vllm:prefix_cache_hits_total") > 0
    _cache_drains(base)
    assert [len(ids) for ids in served] == MAX_TOKENS
    if setting == "16-bit":
        with engine(model, dtype=DTYPE, max_model_len=MAX_LEN) as llm:  # stock vLLM, compression off
            alone = [greedy(llm, [p], n)[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
        assert served == alone, [i for i, (a, b) in enumerate(zip(served, alone)) if a != b]


def test_clients_that_leave_mid_stream(busy_server):
    """Streams closed after a few chunks are aborted: their blocks come back to the pool."""
    import httpx
    base, proc, _, _ = busy_server

    def leave_early(i: int) -> int:
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}
        chunks = 0
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break  # leaving the block closes the connection
        return chunks

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(leave_early, range(16))) == [3] * 16
    _cache_drains(base)
    assert proc.poll() is None


@pytest.mark.parametrize("body, field", [
    ({"prompt": prose(600, seed=1), "max_tokens": 4}, "maximum context length"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "The quick", "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"prompt": "The quick", "max_tokens": 4, "top_p": 2}, "top_p"),
    ({"prompt": "The quick", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "The quick", "max_tokens": 4, "n": 0}, "n"),
])
def test_client_faults_get_4xx(busy_server, body, field):
    """A bad request is answered 4xx with a message naming what was wrong; the server goes on."""
    import httpx
    base, _, _, _ = busy_server
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", **body}, timeout=120)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert field.lower() in r.text.lower(), r.text
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_prompt_at_the_maximum_length(busy_server, model):
    """A prompt that fills the context but for its completion is served in full."""
    from transformers import AutoTokenizer
    base, _, _, _ = busy_server
    ids = AutoTokenizer.from_pretrained(model)(prose(900, seed=5)).input_ids[:MAX_LEN - 4]
    assert len(_complete(base, ids, 4, stream=False)) == 4


def test_sigterm_under_load_ends_cleanly(busy_server):
    """SIGTERM while clients wait: the engine stops at once (vLLM's default --shutdown-timeout 0
    aborts what runs), and the HTTP server, which waits for open connections to close, exits with
    status 0 and nothing from the plugin in its log once the clients give up (here after 15 s). Runs last: it ends the
    module's server."""
    base, proc, log, _ = busy_server
    pool = concurrent.futures.ThreadPoolExecutor(16)
    pending = [pool.submit(_complete, base, p, 200, True, 15) for p in PROMPTS[:16]]
    time.sleep(3)
    before = len(log.read_text())  # the log so far; what the plugin says after the signal is checked
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        # each client has its answer or an error: none is left waiting
        concurrent.futures.wait(pending, timeout=20)
        assert all(f.done() for f in pending)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    # vLLM logs EngineDeadError for each stream the shutdown cut off; none of it may come from the plugin
    after = log.read_text()[before:]
    assert "vllm_kvcompress" not in after, after[-3000:]
