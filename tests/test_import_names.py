"""The checkout's top-level ``triton_kernels/`` folder never stands in for the upstream package of
that name, which vLLM imports: from the checkout's root, ``import triton_kernels`` gives what it
gives elsewhere (the upstream package, vLLM's bundled copy, or ModuleNotFoundError)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import importlib.util, triton_kernels; print(triton_kernels.__file__); "
         "import vllm_kvcompress.triton_kernels.decode as d; print(d.__file__)")


def _run(cwd, first_on_path=None):
    """The probe in ``cwd`` (``-c`` puts it first on ``sys.path``), ``first_on_path`` next."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (first_on_path, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_from_the_root_an_upstream_package_is_found(tmp_path):
    upstream = tmp_path / "site" / "triton_kernels"
    upstream.mkdir(parents=True)
    (upstream / "__init__.py").write_text("")
    run = _run(ROOT, str(tmp_path / "site"))
    assert run.returncode == 0, run.stderr[-2000:]
    first, second = run.stdout.split()
    assert first == str(upstream / "__init__.py")
    assert second == str(ROOT / "triton_kernels" / "decode.py")  # our kernels still import as ours


def test_from_the_root_no_upstream_package_is_no_package():
    if any((Path(p) / "triton_kernels").is_dir() for p in sys.path if Path(p or ".").resolve() != ROOT):
        import pytest
        pytest.skip("an upstream triton_kernels is installed here")
    run = _run(ROOT)
    assert "ModuleNotFoundError: No module named 'triton_kernels'" in run.stderr or "vllm/third_party" in run.stdout
