"""Running vLLM commands as logged subprocesses."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

OFFLINE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1"}


def env() -> dict:
    return {**OFFLINE_ENV, **os.environ}


def run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` with stdout and stderr into ``log``; (return code, log text). 124 on timeout."""
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
            f.write(f"\nerror: timed out after {timeout:.0f} s\n")
    return rc, Path(log).read_text(errors="replace")
