#!/usr/bin/env bash
# The test suite: formats, config, and a real vLLM CPU engine and server with tiny models. Two
# workers, a file each at a time (pytest-xdist; tests/conftest.py gives each worker's engines a core).
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
