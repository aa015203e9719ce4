"""The long-context cost curve: `glm5lab.report.long_context` renders and plots a record of
`benchmarks/long_context.py`'s layout (a small hand-made one), refuses what is not one, and the
benchmark's argument handling, crossover, goals and FLOP bookkeeping hold (without running it)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from glm5lab import ModelConfig
from glm5lab.report.long_context import RESULT, load_record, plot, render_section

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py"


def _bench():
    spec = importlib.util.spec_from_file_location("long_context_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _phase(dense_s, dsa_s):
    return {"dense": {"s": dense_s}, "dsa": {"s": dsa_s}}


def _record():
    curve = [{"T": T, "prefill": _phase(p_dense, p_dsa), "decode": _phase(d_dense, d_dsa),
              "prefill_attention": {"dense_over_dsa": p_dense / p_dsa * 1.5},
              "decode_attention": {"dense_over_dsa": d_dense / d_dsa * 3}}
             for T, p_dense, p_dsa, d_dense, d_dsa in ((4096, 1.0, 2.0, 0.004, 0.005), (32768, 30.0, 20.0, 0.02, 0.01))]
    ic = {"T": 32768, "speedup": {"prefill": {"full": 1.0, "retain_1_2": 1.3, "retain_1_4": 1.6},
                                  "decode": {"full": 1.0, "retain_1_2": 1.2, "retain_1_4": 1.4}},
          "prefill": {n: {"per_layer_s": s} for n, s in (("full", 20.0), ("retain_1_2", 15.0), ("retain_1_4", 12.5))},
          "decode": {n: {"per_layer_s": s} for n, s in (("full", 0.01), ("retain_1_2", 0.008), ("retain_1_4", 0.007))}}
    goals = {"a": {"text": "prefill at 32K: DSA <= 0.5 x dense", "shown": "0.67", "met": False},
             "b": {"text": "64K DSA memory <= 4 GiB", "shown": "not measured", "met": None}}
    return {"benchmark": "long_context", "command": "benchmarks/long_context.py --lengths 4096,32768",
            "dtype": "float32", "curve": curve, "indexcache": [ic], "goals": goals,
            "crossover": {"prefill": {"text": "~12000"}, "decode": {"text": "~9000"}},
            "env": {"date_utc": "2026-12-01 12:00", "git_commit": "0123456789abcdef", "device": "cpu",
                    "torch_threads": 1, "load_average_start": [0.1, 0.1, 0.1], "load_average_end": [0.2, 0.1, 0.1]}}


def test_section_shows_the_curve_with_how_it_was_recorded():
    text = render_section(_record(), "long_context.png")
    assert "| 4096 | 1.000 | 2.000 | 0.50x | 4.00 | 5.00 | 0.80x | - |" in text
    assert "| 32768 | 30.000 | 20.000 | 1.50x | 20.00 | 10.00 | 2.00x | 1.60x / 1.40x |" in text
    assert "`benchmarks/long_context.py --lengths 4096,32768`" in text and "git 0123456789ab" in text
    assert "1 torch threads" in text and "2026-12-01 12:00" in text
    assert "prefill ~12000, decode ~9000" in text
    assert "DSA <= 0.5 x dense: 0.67 -> MISSED" in text and "4 GiB: not measured" in text
    assert "![long-context cost curve](long_context.png)" in text


def test_absent_record_is_one_line_and_bad_files_are_not_records(tmp_path):
    text = render_section(None)
    assert "Not recorded" in text and len([ln for ln in text.splitlines() if ln]) == 2  # the heading and the line
    assert load_record(tmp_path / "absent.json") is None
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "prefill"}))
    (tmp_path / "bad.json").write_text("{not json")
    assert load_record(tmp_path / "other.json") is None and load_record(tmp_path / "bad.json") is None
    (tmp_path / "lc.json").write_text(json.dumps(_record()))
    assert load_record(tmp_path / "lc.json")["curve"][0]["T"] == 4096
    assert RESULT.parts[-3:] == ("benchmarks", "results", "long_context.json")


def test_plot_writes_a_png(tmp_path):
    path = plot(_record(), tmp_path / "lc.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000


def test_quick_arguments_write_nothing_and_the_default_writes_the_record():
    bench = _bench()
    quick = bench.parse_args(["--quick"])
    assert (quick.length_list, quick.ic_list, quick.json_out, quick.png) == ([512, 1024, 2048], [1024], "", "")
    full = bench.parse_args([])
    assert full.length_list == [1024, 2048, 4096, 8192, 16384, 32768, 65536] and full.ic_list == [4096, 16384, 32768]
    assert full.json_out.endswith("benchmarks/results/long_context.json")
    assert full.png.endswith("docs/figures/long_context.png")
    assert [bench.repeats_for(full, T) for T in (8192, 16384, 32768, 65536)] == [3, 2, 2, 1]
    with pytest.raises(SystemExit):
        bench.parse_args(["--lengths", "256"])  # at or below index_topk DSA selects nothing


def test_crossover_and_goal_verdicts():
    bench = _bench()
    at = bench.crossover([(4096, 1.5), (8192, 1.2), (16384, 0.8)])
    assert at["relation"] == "at" and 8192 < at["T"] < 16384 and at["T"] == pytest.approx(2 ** 13.5)
    assert bench.crossover([(1024, 0.9)])["text"] == "below 1024"
    assert bench.crossover([(1024, 1.1), (2048, 1.05)])["text"] == "above 2048"
    assert bench.crossover_value({"relation": "above", "T": 2048}, 8192) is None      # undecided
    assert bench.crossover_value({"relation": "above", "T": 16384}, 8192) == math.inf  # missed
    assert bench.crossover_value({"relation": "below", "T": 1024}, 8192) == 1024      # met
    g = bench.goals({}, {}, {"prefill_modules": at}, 100.0)
    assert g["prefill_crossover"]["met"] is False and g["prefill_dsa_over_dense"]["met"] is None


def test_part_flops_follow_the_ledger():
    bench = _bench()
    cfg = ModelConfig.from_preset("bench", num_hidden_layers=1, indexer_types=["full"], mlp_layer_types=["dense"])
    T, I, J = 4096, cfg.index_n_heads, cfg.index_head_dim
    parts = {n: {"s": 1.0} for n in ("indexer_scoring", "scoring_topk", "sparse_core", "dense_core")}
    parts["scoring_topk"]["s"] = 1.5
    bench.add_flops(parts, cfg, T, prefill=True, peak_gflops=100.0)
    assert parts["indexer_scoring"]["flops"] == 2 * I * (J + 1) * T * (T + 1) / 2
    assert parts["dense_core"]["flops"] == 2 * 8 * (256 + 256) * T * (T + 1) / 2
    assert parts["sparse_core"]["flops"] == pytest.approx(parts["sparse_core"]["ledger_flops"] * (2 * 512 + 64) / 512)
    assert parts["topk"]["s"] == 0.5 and parts["dsa_attention"]["s"] == 2.5
    assert parts["indexer_scoring"]["pct_peak"] == pytest.approx(parts["indexer_scoring"]["flops"] / 1e9)
