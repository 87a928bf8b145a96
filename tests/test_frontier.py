"""The frontier plot's inputs: a quality run, later runs of some settings on the same windows, and
kvpress rows beside them (``benchmarks.frontier``)."""

import pytest

from benchmarks.frontier import frontier, merged_runs

SIZES = {"contexts": [1024, 2048], "ppl_windows": 4, "chunk": 256}


def _run(rows, text="essays", **sizes):
    return {"model": "smollm2", "text": text, "dtype": "float32", "device": "cpu", "sizes": SIZES | sizes,
            "rows": [{"setting": s, "kv_vs_16bit": x, "ppl_2048": p} for s, x, p in rows]}


def test_a_later_run_replaces_the_settings_it_ran_again():
    first = _run([("16-bit (auto)", 1.0, 20.0), ("quant-k4v4", 3.66, 20.1), ("quant-k2v2-o1-clip", 6.51, 22.0)])
    later = _run([("16-bit (auto)", 1.0, 20.0), ("quant-k2v2-o1-clip", 6.51, 21.4), ("quant-k3v3", 4.7, 20.5)])
    merged = merged_runs([first, later])
    assert [(r["setting"], r["ppl_2048"]) for r in merged["rows"]] == [
        ("16-bit (auto)", 20.0), ("quant-k4v4", 20.1), ("quant-k2v2-o1-clip", 21.4), ("quant-k3v3", 20.5)]
    assert first["rows"][2]["ppl_2048"] == 22.0  # the inputs are left as they were


@pytest.mark.parametrize("later, message", [
    (_run([("16-bit (auto)", 1.0, 20.5)]), "16-bit perplexity @2048 is 20.5, the first's 20"),
    (_run([("16-bit (auto)", 1.0, 20.0)], text="code"), "text is 'code' in a run to add, 'essays'"),
    (_run([("16-bit (auto)", 1.0, 20.0)], ppl_windows=1), "ppl_windows is 1 in a run to add, 4"),
])
def test_runs_of_other_windows_are_refused(later, message):
    with pytest.raises(SystemExit, match=message):
        merged_runs([_run([("16-bit (auto)", 1.0, 20.0)]), later])


def test_kvpress_rows_go_beside_against_their_own_16_bit_row(tmp_path, monkeypatch):
    from benchmarks import frontier as module
    drawn = []
    monkeypatch.setattr(module.report, "save_figure", lambda fig, path, note: drawn.append(fig))
    run = _run([("16-bit (auto)", 1.0, 20.0), ("quant-k4v4", 3.66, 20.2)])
    kvpress = {"model": "smollm2", "text": "essays", "ppl_windows": 4, "chunk": 256, "contexts": [1024, 2048],
               "rows": [{"setting": "16-bit", "kv_vs_16bit": 1.0, "ppl_2048": 10.0},
                        {"setting": "quanto-int4", "kv_vs_16bit": 2.69, "ppl_2048": 11.0}]}
    frontier(run, tmp_path / "f.png", [kvpress])
    texts = {t.get_text(): t.xy for t in drawn[0].axes[0].texts}
    assert texts["kvpress quanto int4"] == pytest.approx((2.69, 10.0))  # +10% against its own 16-bit row
    assert texts["quant-k4v4"] == pytest.approx((3.66, 1.0))
    assert "kvpress 16-bit" not in texts
    with pytest.raises(SystemExit, match="model is 'gemma3' in a run to add"):
        frontier(run, tmp_path / "f.png", [kvpress | {"model": "gemma3"}])


def test_the_command_leaves_out_settings_and_refuses_unknown_ones(tmp_path, monkeypatch):
    import json

    from benchmarks import frontier as module
    drawn = []
    monkeypatch.setattr(module, "frontier", lambda result, path, beside: drawn.append(result))
    run = tmp_path / "results.json"
    run.write_text(json.dumps(_run([("16-bit (auto)", 1.0, 20.0), ("quant-k4v4", 3.66, 20.2),
                                    ("quant-k2v2-o1-deleted", 6.51, 21.0)])))
    module.main([str(run), "--without", "quant-k2v2-o1-deleted", "--out", str(tmp_path / "f.png")])
    assert [r["setting"] for r in drawn[0]["rows"]] == ["16-bit (auto)", "quant-k4v4"]
    with pytest.raises(SystemExit, match="--without quant-k9: no such setting"):
        module.main([str(run), "--without", "quant-k9", "--out", str(tmp_path / "f.png")])
