"""The expert-kernel sweep (issue 39 item 5, `glm5lab.expert_sweep`): the useful-FLOP count against hand-computed
numbers, the skew generators (exact sums, shapes, the hot expert's share, hand-rounded Zipf counts, bad input
refused by name), the memory estimate, a tiny sweep's record, the half-peak finder, the report section and
`benchmarks/expert_kernels.py --quick`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from glm5lab.expert_sweep import (DIRECTIONS, KERNELS, SHAPES, SKEWS, ExpertShape, SweepPlan, expert_counts, half_peak,
                                  half_peak_text, kernel_bytes, sweep, useful_flops)
from glm5lab.report import expert_kernels

ROOT = Path(__file__).resolve().parents[1]
TINY = ExpertShape("tiny", 8, 64, 32)


def test_useful_flops_by_hand():
    small = SHAPES["small"]  # 16 experts of 256 x 128
    assert useful_flops(32, small, "forward") == 6_291_456        # 3 matmuls x 2 x 32 rows x 256 x 128
    assert useful_flops(32, small, "backward") == 12_582_912
    assert useful_flops(1, SHAPES["glm5/8"], "forward") == 6 * 768 * 256 == 1_179_648
    with pytest.raises(ValueError, match="direction = 'both' is not allowed"):
        useful_flops(1, small, "both")


@pytest.mark.parametrize("skew", SKEWS)
@pytest.mark.parametrize("experts, m", [(2, 1), (5, 1), (16, 4), (32, 1), (32, 4096), (7, 13)])
def test_counts_sum_exactly_with_one_count_per_expert(skew, experts, m):
    counts = expert_counts(skew, experts, m)
    assert counts.shape == (experts,) and counts.dtype == torch.int64
    assert int(counts.sum()) == experts * m and int(counts.min()) >= 0
    if skew != "one_hot":  # zipf and uniform: expert 0 the hottest, counts never increase with the rank
        assert all(a >= b for a, b in zip(counts.tolist(), counts.tolist()[1:]))


def test_skews_by_hand():
    assert expert_counts("uniform", 4, 3).tolist() == [3, 3, 3, 3]
    # zipf 1.0, A = 12: 12 * (1, 1/2, 1/3, 1/4) / (25/12) = 5.76, 2.88, 1.92, 1.44 -> floors 5, 2, 1, 1 (9);
    # the 3 left go to the largest fractions .92, .88, .76
    assert expert_counts("zipf1.0", 4, 3).tolist() == [6, 3, 2, 1]
    # zipf 1.5, A = 8: 8 * (1, .35355, .19245, .125) / 1.67100 = 4.787, 1.693, .921, .598 -> 4, 1, 0, 0; +3
    assert expert_counts("zipf1.5", 4, 2).tolist() == [5, 2, 1, 0]
    assert expert_counts("one_hot", 4, 3).tolist() == [6, 2, 2, 2]       # half of 12, the rest evenly
    assert expert_counts("one_hot", 5, 1).tolist() == [2, 1, 1, 1, 0]    # 3 over 4 experts: ties to the lower
    # small (top-2, 2048 tokens): every token picks expert 0; 2048 over 15 = 136.53
    assert expert_counts("one_hot", 16, 256).tolist() == [2048] + [137] * 8 + [136] * 7


def test_bad_skew_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="skew = 'zipf2' is not allowed: one of"):
        expert_counts("zipf2", 4, 1)
    with pytest.raises(ValueError, match="experts = 1 is not allowed"):
        expert_counts("uniform", 1, 1)
    with pytest.raises(ValueError, match="tokens_per_expert = 0 is not allowed"):
        expert_counts("uniform", 4, 0)
    with pytest.raises(ValueError, match="kernel = 'fused' is not allowed"):
        SweepPlan(shapes=[TINY], skews=["uniform"], tokens=[1], kernels=["fused"], directions=["forward"],
                  device=torch.device("cpu"), dtype=torch.float32)


def test_time_basis_is_cpu_time_on_cpu_and_synchronised_wall_time_on_cuda():
    def plan(device):
        return SweepPlan(shapes=[TINY], skews=["uniform"], tokens=[1], kernels=["loop"], directions=["forward"],
                         device=torch.device(device), dtype=torch.float32)
    assert plan("cpu").time_basis() == "cpu" and plan("cuda").time_basis() == "wall"


def test_kernel_bytes_by_hand():
    counts = torch.tensor([65, 1])
    small = SHAPES["small"]
    # grouped: 3 tiles of 64 (2 for 65 rows, 1 for 1): 66 + 192 rows of 2D + 3I values, 3 tiles of 3 D I weights,
    # all twice (backward), 4 bytes
    assert kernel_bytes("grouped", counts, small, 4) == 8 * (258 * 896 + 3 * 3 * 256 * 128)
    assert kernel_bytes("gathered", counts, small, 4) == 8 * (66 * 896 + 66 * 3 * 256 * 128)
    assert kernel_bytes("loop", counts, small, 2) == 4 * 66 * 896 == kernel_bytes("grouped_mm", counts, small, 2)


def test_a_tiny_sweep_records_every_cell_with_its_useful_flops():
    plan = SweepPlan(shapes=[TINY], skews=["uniform", "zipf1.5"], tokens=[1, 4], kernels=list(KERNELS),
                     directions=list(DIRECTIONS), device=torch.device("cpu"), dtype=torch.float32, rounds=1,
                     target_s=0.001, max_reps=2, peak_n=64)
    rec = sweep(plan)
    assert rec["time_basis"] == "cpu" and rec["skipped"] == [] and rec["stopped_at"] is None
    assert len(rec["peak"]["samples"]) == 4 and rec["peak"]["flops_per_s"] > 0
    assert len(rec["points"]) == 2 * 2 * 4 * 2
    for p in rec["points"]:
        rows = 8 * p["tokens_per_expert"]
        assert p["flops"] == (6 if p["direction"] == "forward" else 12) * rows * 64 * 32
        assert p["cpu_s"] > 0 and p["wall_s"] > 0 and p["share"] == pytest.approx(
            p["flops"] / p["cpu_s"] / rec["peak"]["flops_per_s"])
    assert {p["max_count"] for p in rec["points"] if p["skew"] == "zipf1.5" and p["tokens_per_expert"] == 4} == {17}  # 32 / 1.9267


def test_kernels_over_the_memory_bound_are_skipped_and_said_so():
    plan = SweepPlan(shapes=[TINY], skews=["uniform"], tokens=[4], kernels=["loop", "gathered"],
                     directions=["forward"], device=torch.device("cpu"), dtype=torch.float32, rounds=1,
                     target_s=0.001, max_reps=1, max_bytes=1_000_000, peak_n=64)
    rec = sweep(plan)
    assert {p["kernel"] for p in rec["points"]} == {"loop"}
    assert [(s["kernel"], s["reason"].split(":")[0]) for s in rec["skipped"]] == [("gathered", "memory")]


def _line(shares: dict[int, float], kernel="grouped", direction="forward") -> list[dict]:
    return [{"shape": "s", "skew": "uniform", "kernel": kernel, "direction": direction, "tokens_per_expert": m,
             "share": v} for m, v in shares.items()]


def test_half_peak_is_the_first_point_at_half_or_never_with_the_best():
    pts = (_line({1: 0.1, 16: 0.3, 64: 0.55, 256: 0.45, 1024: 0.7}) + _line({1: 0.2, 16: 0.4}, kernel="loop")
           + _line({1: 0.2, 16: 0.5, 64: 0.9}, kernel="grouped_mm"))
    h = half_peak(pts, "s", "uniform", "grouped", "forward")
    assert (h["first"], h["below_again"], h["best"]) == (64, 256, (0.7, 1024))
    assert half_peak_text(pts, "s", "uniform", "grouped", "forward") == "at 64, under again from 256"
    assert half_peak_text(pts, "s", "uniform", "grouped_mm", "forward") == "from 16"  # 0.5 counts as half
    assert half_peak_text(pts, "s", "uniform", "loop", "forward") == "never (best 40% at 16)"
    assert half_peak_text(pts, "s", "uniform", "loop", "backward") == "not measured"


def test_report_section_and_figure(tmp_path):
    from glm5lab import ModelConfig

    rec = expert_kernels.measure_for_report(ModelConfig.from_preset("tiny"), quick=True)
    assert rec["shape"] == {"name": "this run", "experts": 8, "hidden": 64, "intermediate": 32}
    assert {p["tokens_per_expert"] for p in rec["points"]} == {1, 16} and torch.get_num_threads() >= 1
    text = expert_kernels.render_section(rec, "expert_kernels.png", 512.0)
    assert "### Expert kernels: share of the matmul peak" in text and "(8 experts of 64 x 32)" in text
    assert "| grouped (padded batch) |" in text and "Half of the peak reached (tokens per expert): loop:" in text
    assert "512 assignments per expert (the red line)" in text and "![expert kernels](expert_kernels.png)" in text
    png = expert_kernels.plot(rec, tmp_path / "k.png", marker=512, title=expert_kernels.report_title(rec))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "Not measured" in expert_kernels.render_section(None, None, None)
    assert expert_kernels.run_tokens_per_expert([{"step": 1, "expert_load": [[3, 5], [1, 1]]}]) == 4.0
    assert expert_kernels.run_tokens_per_expert([{"step": 1}]) is None


def test_benchmark_quick_writes_its_record_table_and_figure(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import expert_kernels as bench

    rec = bench.main(["--quick", "--threads", "1", "--json-out", str(tmp_path / "r.json"),
                      "--png", str(tmp_path / "r.png")])
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["benchmark"] == "expert_kernels" and last["threads"] == 1 and "load_average_start" in last
    assert "| small | uniform | 256 |" in out and "half of the peak reached from" in out
    assert json.loads((tmp_path / "r.json").read_text())["points"] == rec["points"]
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(rec["half_peak"]["small|grouped|forward"]) == {"uniform", "one_hot"}


def test_benchmark_quick_leaves_the_full_sweeps_record_and_figure_alone(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import expert_kernels as bench

    monkeypatch.setattr(bench, "RECORD", tmp_path / "record.json")
    monkeypatch.setattr(bench, "FIGURE", tmp_path / "figure.png")
    bench.main(["--quick", "--threads", "1"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["json_out"] is None and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, line", [
    (["--max-gib", "nan"], "--max-gib = nan: rounds >= 1 and positive finite seconds and GiB are allowed"),
    (["--target-s", "inf"], "--target-s = inf, --max-gib = 4.0: rounds >= 1 and positive finite seconds"),
    (["--quick", "--json-out", "{tmp}"], "--json-out = '{tmp}' is not allowed: a file path (it is a folder)"),
    (["--quick", "--rounds", "5", "--max-gib", "1"], "--rounds, --max-gib applies only to the full sweep: --quick "
     "fixes its own timings; drop --quick or them"),
])
def test_benchmark_bad_flags_are_refused_in_one_line_before_measuring(tmp_path, capsys, args, line):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import expert_kernels as bench

    with pytest.raises(SystemExit) as e:
        bench.main([a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and line.format(tmp=tmp_path) in err[-1], err


def test_benchmark_plans_a_peak_matmul_big_enough_for_a_gpu():
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import expert_kernels as bench

    quick = argparse.Namespace(quick=True, dtype="bf16")
    assert bench.plan_of(quick, torch.device("cuda")).peak_n == 8192
    assert bench.plan_of(quick, torch.device("cpu")).peak_n == 512
    full = argparse.Namespace(quick=False, dtype="bf16", rounds=2, target_s=0.1, max_gib=4.0)
    cuda = bench.plan_of(full, torch.device("cuda"))
    assert (cuda.peak_n, cuda.dtype, cuda.max_bytes, len(cuda.shapes), cuda.tokens[-1]) == (
        8192, torch.bfloat16, 4 * 2**30, 2, 4096)
