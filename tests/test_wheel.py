"""The package as a user installs it: a wheel built from the checkout, installed into a fresh
virtual environment (vLLM, torch and the rest come from this one's site-packages through a .pth
file; the plugin only from the wheel), run from outside the checkout. And the layout that makes
it so: no symlinks, no ``sys.path`` edits."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# what the wheel is built from (pyproject.toml's packages and package-dir)
SOURCES = ("pyproject.toml", "README.md", "vllm_kvcompress", "triton_kernels", "csrc", "configs")

CHECK = """
import json, sys
from pathlib import Path
import vllm_kvcompress, vllm_kvcompress.cuda_jit as cuda_jit, vllm_kvcompress.triton_kernels.decode as decode
from vllm import LLM, SamplingParams

def backends(worker):
    from vllm.model_executor.layers.attention.attention import Attention
    return sorted({m.attn_backend.get_name() for m in worker.model_runner.model.modules() if isinstance(m, Attention)})

if __name__ == "__main__":
    llm = LLM(sys.argv[1], enforce_eager=True, kv_cache_memory_bytes=32 << 20, dtype="float32", seed=0,
              max_model_len=1024, additional_config={"kv_compression": "quant-k4v4"})
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    print("RESULT", json.dumps({
        "package": vllm_kvcompress.__file__, "decode": decode.__file__,
        "csrc": sorted(p.name for p in cuda_jit.CSRC.iterdir() if p.suffix in (".cu", ".cuh")),
        "csrc_dir": str(cuda_jit.CSRC), "backends": llm.llm_engine.collective_rpc(backends)[0],
        "tokens": list(out[0].outputs[0].token_ids)}))
    llm.llm_engine.engine_core.shutdown()
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; this venv's packages (vLLM, torch, ...) through a .pth."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so that the build leaves nothing (build/, *.egg-info) in the checkout
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src],
                   check=True, timeout=120)
    (wheel,) = (tmp / "dist").glob("vllm_kvcompress-*.whl")
    env = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True, timeout=60)
    python = env / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
                   check=True, timeout=120)
    return env


def run_outside(venv: Path, *args, timeout=120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(a) for a in args], cwd=venv, capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_wheel_lists_every_preset(venv):
    run = run_outside(venv, venv / "bin" / "kvcompress", "presets")
    assert run.returncode == 0, run.stderr[-3000:]
    listed = {line.split()[0] for line in run.stdout.splitlines() if line.strip()}
    assert listed == {p.stem for p in (REPO / "configs").glob("*.yaml")}


def test_wheel_has_every_package_and_kernel_source(venv):
    run = run_outside(venv, venv / "bin" / "python", "-c", "import vllm_kvcompress; print(vllm_kvcompress.__file__)")
    package = Path(run.stdout.strip()).parent
    assert venv in package.parents  # the plugin is the wheel's, not the checkout's
    for init in (REPO / "vllm_kvcompress").rglob("__init__.py"):  # every subpackage
        assert (package.parent / init.relative_to(REPO)).is_file(), init
    for folder in ("triton_kernels", "csrc", "configs"):  # installed as vllm_kvcompress.<folder>
        sources = {p.name for p in (REPO / folder).iterdir() if p.suffix in (".py", ".cu", ".cuh", ".yaml")}
        assert sources <= {p.name for p in (package / folder).iterdir()}, folder


@pytest.mark.engine
def test_wheel_runs_quant_k4v4_outside_the_checkout(venv, mha):
    run = run_outside(venv, venv / "bin" / "python", "-c", CHECK, mha, timeout=300)
    line = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, (run.stdout + run.stderr)[-3000:]
    got = json.loads(line[0][len("RESULT "):])
    for key in ("package", "decode", "csrc_dir"):
        assert Path(got[key]).is_relative_to(venv), got[key]
    assert {"decode_kernel.cu", "write_kernel.cu"} <= set(got["csrc"])
    assert got["backends"] == ["KVCOMPRESS"]
    assert len(got["tokens"]) == 8


def test_no_symlinks_or_sys_path_edits():
    """Installed or editable, the package finds its kernels, CUDA sources and presets through
    pyproject.toml's package-dir; scripts find the tests' helpers through PYTHONPATH or pytest's
    pythonpath. Neither a symlink nor an edit of sys.path should come back."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t")[1] for line in files.splitlines() if line.startswith("120000 ")]
    assert not links, f"symlinks in the tree: {links}"
    edit = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove)\s*\(|\[[^]]*\]\s*=|\+?=)|site\.addsitedir")
    found = []
    for line in files.splitlines():
        name = line.split("\t")[1]
        path = REPO / name
        if name.endswith((".py", ".sh")) and path.is_file():
            found += [f"{name}: {text.strip()}" for text in path.read_text().splitlines() if edit.search(text)]
    assert not found, "\n".join(found)
