"""Starting ``kvcompress serve`` the way the README says, on a free local port."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvcompress() -> list[str]:
    exe = shutil.which("kvcompress", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "vllm_kvcompress.cli"]


def server_env() -> dict:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine in its own process
    return env


def start_server(model, args: list[str], log: Path, timeout: float = 240) -> tuple[subprocess.Popen, str]:
    """``kvcompress serve MODEL ARGS`` on 127.0.0.1 with its output in ``log``; returns the process
    and its base URL once /health answers. Fails with the log's tail if it exits or never answers.
    A port that another test took between choosing and binding it is chosen again."""
    for _ in range(3):
        port = free_port()
        cmd = [*kvcompress(), "serve", str(model), *args, "--host", "127.0.0.1", "--port", str(port)]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env())
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + timeout
        while proc.poll() is None and time.time() < deadline:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                return proc, base
            except OSError:
                time.sleep(1)
        proc.kill()
        proc.wait()
        if "Address already in use" not in log.read_text():
            break
    raise AssertionError("server did not come up:\n" + log.read_text()[-3000:])
