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
    ("default: {k_bits: 4, v_rotation: true}", ["v_rotation", "v_bits = 16", "allowed: v_bits below 16"]),
    ("default: {k_bits: 4, v_bits: 4, v_axis: channel, v_rotation: true}", ["v_rotation", "v_axis = 'channel'",
                                                                           "v_axis 'token'"]),
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
