"""Config loading: presets, files, and one clear message for each bad input."""

import pytest

from vllm_kvcompress.config import KVCompressionConfigError, load_config, preset_names


def test_presets_load():
    assert {"quant-k8v8", "quant-k4v4", "quant-k2v2"} <= set(preset_names())
    cfg = load_config("quant-k4v4")
    assert (cfg.default.k_bits, cfg.default.v_bits, cfg.default.k_axis, cfg.default.v_axis) == (4, 4, "channel", "token")


def test_per_layer_overrides_and_full_precision(tmp_path):
    path = tmp_path / "mixed.yaml"
    path.write_text("default: {k_bits: 2, v_bits: 2}\nlayers:\n  1: {k_bits: 4}\nfull_precision_layers: [3]\n")
    cfg = load_config(str(path))
    assert (cfg.layer_format(0).k_bits, cfg.layer_format(0).v_bits) == (2, 2)
    assert (cfg.layer_format(1).k_bits, cfg.layer_format(1).v_bits) == (4, 2)
    assert cfg.layer_format(3).is_uncompressed


def test_json_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"default": {"k_bits": 8, "v_bits": 4}}')
    assert load_config(str(path)).layer_format(0).v_bits == 4


@pytest.mark.parametrize("text, expected", [
    ("default: {k_bits: 5}", ["default.k_bits", "5", "allowed: 2, 3, 4, 8, 16"]),
    ("default: {k_bits: 4}\nlayers: {2: {v_bits: 7}}", ["layers.2.v_bits", "7", "allowed: 2, 3, 4, 8, 16"]),
    ("defaults: {k_bits: 4}", ["unknown field 'defaults'", "allowed fields here", "default"]),
    ("default: {k_bits: 4, kbits: 4}", ["unknown field 'default.kbits'", "k_bits"]),
    ("default: {k_axis: row}", ["default.k_axis", "'row'", "channel", "token"]),
    ("default: [k_bits: 4", ["malformed YAML"]),
    ("- 1\n- 2", ["expected a mapping"]),
])
def test_bad_files_name_field_value_and_allowed(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(KVCompressionConfigError) as err:
        load_config(str(path))
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    for part in expected:
        assert part in message


def test_missing_file_names_presets():
    with pytest.raises(KVCompressionConfigError, match=r"'nope\.yaml': no such file.*quant-k4v4"):
        load_config("nope.yaml")


def test_layer_past_model():
    cfg = load_config({"default": {"k_bits": 4}, "layers": {40: {"k_bits": 8}}})
    cfg.check_layers(41)
    with pytest.raises(KVCompressionConfigError, match=r"'layers' names layer 40.*4 attention layers.*0\.\.3"):
        cfg.check_layers(4)
    with pytest.raises(KVCompressionConfigError, match="full_precision_layers"):
        load_config({"full_precision_layers": [9]}).check_layers(4)


def test_cuda_kernel_checks_refuse_head_size_and_dtype_and_name_slow_layers():
    """What the CUDA path can't decode is refused at startup (head size, dtype) or named (formats
    that fall back to the torch path), before any kernel runs."""
    import torch

    from vllm_kvcompress.engine_config import ModelKVShape, check_cuda_kernels

    cfg = load_config({"default": {"k_bits": 4, "v_bits": 4},
                       "layers": {2: {"rpc_fraction": 0.1, "rpc_tokens": 16}, 3: {"k_axis": "token"}}})
    shape = ModelKVShape(num_layers=4, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, block_size=128)
    assert check_cuda_kernels(cfg, shape) == ["layer 2 (recent 16-bit window (KVmix RPC))",
                                              "layer 3 (K quantized per token)"]
    assert check_cuda_kernels(load_config("quant-k2v2"), shape) == []
    with pytest.raises(KVCompressionConfigError, match=r"head size 80 is not supported by the CUDA kernels "
                                                       r"\(allowed: 64, 128, 256\)"):
        check_cuda_kernels(cfg, ModelKVShape(4, 2, 80, torch.bfloat16, 128))
    with pytest.raises(KVCompressionConfigError, match=r"--dtype torch.float32 is not supported .* on CUDA "
                                                       r"\(allowed: float16, bfloat16\)"):
        check_cuda_kernels(cfg, ModelKVShape(4, 2, 128, torch.float32, 128))
