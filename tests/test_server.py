"""The OpenAI-compatible server with compression on, started the way the README says."""

import concurrent.futures
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from engine_utils import engine, greedy
from server_utils import free_port, kvcompress, server_env, start_server
from tiny_models import build_llama

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("models") / "server-gqa", num_kv_heads=2, num_heads=4)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc, base = start_server(model, ["--kv-compression", "quant-k4v4", "--dtype", "float32", "--enforce-eager",
                                      "--max-model-len", "1024", "--kv-cache-memory-bytes", str(32 << 20),
                                      "--served-model-name", "tiny"], log)
    try:
        yield f"{base}/v1", log
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_completions_and_chat_concurrently(server, model):
    import openai

    base_url, log = server
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120)
    prompts = ["The quick brown fox", "Serving large language models", "Once upon a time there was"]

    def complete(p):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    def chat(p):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                           max_tokens=12, temperature=0)
        return r.choices[0].message.content, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        completions = list(pool.map(complete, prompts))
        chats = list(pool.map(chat, prompts))
    assert all(n == 12 for _, n in completions + chats)
    assert all(text for text, _ in completions + chats)
    text = log.read_text()
    assert "kv-compression 'quant-k4v4'" in text and "KV tokens in the same memory" in text
    # the ratio names the dtype it is against, and the kernel plan is logged per run of layers
    assert " B in float32: " in text
    assert "kv-compression kernels on cpu:" in text and "K4/channel V4/token: decode torch, prompt torch, write torch" in text

    # the server answers what the same compressed engine computes offline
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    with engine(model, "quant-k4v4") as llm:
        offline = greedy(llm, prompts, max_tokens=12)
    assert [c for c, _ in completions] == [tok.decode(ids) for ids in offline]


def test_bad_config_stops_server_before_it_takes_the_port(model, tmp_path):
    """The config is checked while the flags are parsed: the port is still taken by someone
    else here, and the answer is the config's one line, not the port's."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("default: {k_bits: 5, v_bits: 4}\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cmd = [*kvcompress(), "serve", str(model), "--kv-compression", str(bad),
               "--port", str(taken.getsockname()[1]), "--host", "127.0.0.1"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=server_env())
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith(f"error: argument --kv-compression: kv-compression config {bad}: "
                         "field 'default.k_bits' = 5 is not allowed; allowed: 2, 3, 4, 8, 16"), last


def test_vllm_serve_ends_on_the_refusals_one_line(model):
    """``vllm serve`` itself (not ``kvcompress serve``, which catches the error): a setting the model
    cannot take is refused while the engine's config is made, and the process ends on that one
    line, not on a traceback through vLLM's startup."""
    cli = Path(__file__).resolve().parent.parent / "benchmarks" / "vllm_cli.py"
    cmd = [sys.executable, str(cli), "serve", str(model), "--kv-compression", "slim-k16", "--max-model-len", "512",
           "--host", "127.0.0.1", "--port", str(free_port())]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=server_env())
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: kv-compression config preset 'slim-k16': k_only (slim attention) needs multi-head attention, "
        f"but {model} has 4 query heads and 2 KV heads (grouped-query): W_K is not square")


def test_flag_and_additional_config_are_the_same(model):
    """--kv-compression on any vLLM entry point lands in additional_config, as --additional-config does."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    flag = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", str(model), "--kv-compression", "quant-k2v2"]))
    extra = AsyncEngineArgs.from_cli_args(parser.parse_args(
        ["--model", str(model), "--additional-config", '{"kv_compression": "quant-k2v2"}']))
    assert flag.additional_config == extra.additional_config == {"kv_compression": "quant-k2v2"}
    both = parser.parse_args(["--model", str(model), "--kv-compression", "quant-k2v2",
                              "--additional-config", '{"kv_compression": "quant-k4v4"}'])
    with pytest.raises(ValueError, match="conflicts"):
        AsyncEngineArgs.from_cli_args(both)
