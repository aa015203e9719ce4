"""The mixer comparison (issue 28): `benchmarks/long_context.py --costs` (`benchmarks/mixer_costs.py`)
builds every mixer at the same widths, measures state bytes as the cache holds them, judges the SWA goals
as stated, and `glm5lab.report.attention_costs` renders and plots a record of its layout (a small
hand-made one) and refuses what is not one."""

import json

import pytest
import torch

from glm5lab.report.attention_costs import RESULT, load_record, plot, render_section
from tests.conftest import attention_costs_record, benchmark_module, costs_point

def test_swa_goals_are_exact_state_ratio_and_flat_decode():
    costs = benchmark_module("mixer_costs")
    g = costs.goals([costs_point(8192), costs_point(32768, swa_ms=2.3), costs_point(65536, swa_ms=2.2)], 2048)
    assert g["swa_state"]["met"] is True and g["swa_state"]["value"]["measured"] == 2048 / 65536
    assert g["swa_decode_flat"]["value"] == pytest.approx(2.3 / 2.0) and g["swa_decode_flat"]["met"] is True
    assert g["swa_decode_flat"]["wall_value"] == pytest.approx(2.3 / 2.0)
    slow = costs.goals([costs_point(8192), costs_point(65536, swa_ms=2.5)], 2048)
    assert slow["swa_decode_flat"]["met"] is False  # 1.25 > 1.2
    one = costs.goals([costs_point(2048), costs_point(8192)], 2048)  # only 8K is >= 4 x window: undecided
    assert one["swa_decode_flat"]["met"] is None and one["swa_decode_flat"]["shown"] == "not measured"
    full = costs_point(65536)
    full["state"]["swa"]["ledger"] += 1  # one byte off the exact ratio misses
    assert costs.goals([full], 2048)["swa_state"]["met"] is False


def test_costs_arguments_default_to_their_own_record_and_check_the_mixers():
    lc = benchmark_module("long_context")
    full = lc.parse_args(["--costs"])
    assert full.json_out.endswith("benchmarks/results/attention_costs.json")
    assert full.png.endswith("docs/figures/attention_costs.png")
    assert (full.window, full.dense_cap, full.reference_cap, full.ic_list) == (2048, 16384, 32768, [])
    assert full.length_list == [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    assert full.mixer_list == ["dense", "dsa", "dsa_indexcache", "swa", "swa_interleave", "gdn", "simple_gdn"]
    quick = lc.parse_args(["--costs", "--quick"])
    assert (quick.json_out, quick.png, quick.window, quick.dense_cap, quick.reference_cap) == ("", "", 64, 0, 0)
    assert lc.parse_args(["--costs", "--mixers", "swa"]).mixer_list == ["dense", "swa"]  # dense: the reference
    with pytest.raises(SystemExit):
        lc.parse_args(["--costs", "--mixers", "mamba"])
    assert lc.parse_args([]).json_out.endswith("long_context.json")  # issue 14's curve unchanged


def test_every_mixer_has_the_same_widths_and_its_state_bytes_match_the_ledger():
    costs = benchmark_module("mixer_costs")
    T, window = 300, 64
    models = costs.make_models(costs.MIXERS, window=window, max_T=T, seed=0, device="cpu")
    for key, model in models.items():
        cfg = model.config
        layers = costs.MIXERS[key]["layers"]
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers) == (1024, 8, layers)
        st = costs.state_bytes(model, T)
        assert st["measured"] == st["ledger"], key
    latent = 4 * (512 + 64)
    assert costs.state_bytes(models["dense"], T)["measured"] == latent * T
    assert costs.state_bytes(models["dsa"], T)["measured"] == (latent + 4 * 128) * T
    assert costs.state_bytes(models["dsa_indexcache"], T)["measured"] == (4 * latent + 4 * 128) * T
    assert costs.state_bytes(models["swa"], T)["measured"] == latent * window
    assert costs.state_bytes(models["simple_gdn"], T)["measured"] == 8 * 256 * 256 * 4


def test_zero_filled_cache_decodes_at_T():
    costs = benchmark_module("mixer_costs")
    from glm5lab.infer import decode_step

    model = costs.make_models(["dense"], window=64, max_T=300, seed=0, device="cpu")["dense"]
    cache = costs.zero_filled(model, 300)
    assert cache.lengths.tolist() == [300] and cache.capacity == 301
    with torch.no_grad():
        decode_step(model, torch.tensor([5]), cache)
    assert cache.lengths.tolist() == [301]


def test_section_shows_the_longest_context_with_how_it_was_recorded():
    text = render_section(attention_costs_record(), "attention_costs.png")
    assert "per layer, at 64K tokens" in text and "`benchmarks/long_context.py --costs --lengths 8192,65536`" in text
    assert "git 0123456789ab" in text and "1 torch threads" in text and "SWA window 2048" in text
    assert "| dense MLA | - | 98.30 / 65.54 | 144.00 / 144.00 | - |" in text  # capped prefill: '-'
    assert "| SWA | 0.640 / 0.576 | 3.30 / 2.20 | 4.50 / 4.50 | 64 |" in text
    assert "uncached SDPA forward" not in text  # not run at 64K (--reference-cap)
    assert "of dense MLA's, exactly (measured and ledger): measured 0.03125, ledger 0.03125 -> met" in text
    assert "flat from 8K to 64K (max / min of the step's CPU time <= 1.2): 1.100 (8K 2.00 ms, 64K 2.20 ms; wall" in text
    assert "![attention costs](attention_costs.png)" in text


def test_absent_record_is_one_line_and_bad_files_are_not_records(tmp_path):
    text = render_section(None)
    assert "Not recorded" in text and len([ln for ln in text.splitlines() if ln]) == 2
    assert load_record(tmp_path / "absent.json") is None
    (tmp_path / "lc.json").write_text(json.dumps({"benchmark": "long_context", "curve": []}))
    (tmp_path / "bad.json").write_text("{not json")
    assert load_record(tmp_path / "lc.json") is None and load_record(tmp_path / "bad.json") is None
    (tmp_path / "ac.json").write_text(json.dumps(attention_costs_record()))
    assert load_record(tmp_path / "ac.json")["points"][1]["T"] == 65536
    assert RESULT.parts[-3:] == ("benchmarks", "results", "attention_costs.json")


def test_plot_writes_a_png(tmp_path):
    data = plot(attention_costs_record(), tmp_path / "ac.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000


@pytest.mark.slow
def test_a_short_run_writes_a_record_the_report_reads(tmp_path):
    """The whole `--costs` path at two short lengths (~1 min on a loaded 2-core CPU): every mixer
    measured, state bytes equal to the ledger's, the SWA goals decided, the record and figure written."""
    lc = benchmark_module("long_context")
    out, png = tmp_path / "ac.json", tmp_path / "ac.png"
    rec = lc.main(["--costs", "--lengths", "320,1280", "--decode-steps", "1", "--repeats", "1", "--threads", "1",
                   "--json-out", str(out), "--png", str(png)])
    assert load_record(out)["points"][1]["T"] == 1280 and png.read_bytes()[:4] == b"\x89PNG"
    assert rec["window"] == 40 and rec["goals"]["swa_state"]["met"] is True
    assert rec["goals"]["swa_decode_flat"]["met"] is not None  # 320 and 1280 are >= 4 x 40
    for point in rec["points"]:
        assert all(s["measured"] == s["ledger"] for s in point["state"].values())
        assert all(p is not None and p["s"] > 0 for p in point["prefill"].values())
        assert point["dense_reference"]["s"] > 0
