"""scripts/gpu_check.sh: its table (scripts/gpu_check_table.py) from hand-made step outputs (a step that failed, ran
out of time or is absent is one row saying so; the expert-kernel row reads any record), and (slow) the whole script
in its CPU smoke mode (GPU_CHECK_CPU_SMOKE=1): every step's row, none FAILED or TIMEOUT."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check_table", ROOT / "scripts" / "gpu_check_table.py")
gct = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gct)


def _step(out: Path, name: str, status: str, log: str = "", seconds: int = 3) -> None:
    (out / f"{name}.status").write_text(status + "\n")
    (out / f"{name}.seconds").write_text(f"{seconds}\n")
    (out / f"{name}.log").write_text(log)


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:] if line.startswith("|")]


def test_every_step_has_a_row_saying_how_it_ended(tmp_path):
    _step(tmp_path, "tests", "ok", "....\n===== 5 passed, 1 skipped in 41.2s =====\n")
    _step(tmp_path, "train", "FAILED (exit 1)", "Traceback ...\n")
    (tmp_path / "tests2").mkdir()
    _step(tmp_path / "tests2", "tests", "TIMEOUT (135 s)", "tests/a.py::t1 PASSED [ 30%]\ntests/a.py::t2 FAILED [ 60%]\n"
          "tests/b.py::t3 PASSED [ 90%]\n")
    assert gct.step_rows(tmp_path / "tests2", "tests") == [
        ("CUDA tests", "TIMEOUT (135 s) (see tests.log): 2 passed, 1 failed, 0 skipped, 0 error")]
    (tmp_path / "experts.status").write_text("not present\n")
    _step(tmp_path, "context", "TIMEOUT (100 s)", "partial\n", 100)
    fp8 = {"decode": {"context": 32768, "bytes_ratio": 3.879, "modes": ["eager"],
                      "ms": {"step_eager_fp32": 10.0, "step_eager_fp8": 12.5}}}
    _step(tmp_path, "fp8", "ok", "table\n" + json.dumps(fp8) + "\n")
    _step(tmp_path, "decode", "ok", "no record here\n")
    rows = _rows(gct.table(tmp_path))
    assert rows[0] == ["1. tests (3 s)", "CUDA tests (`pytest -m cuda`: inference and training)",
                       "5 passed, 1 skipped in 41.2s"]
    assert rows[1] == ["2. train (3 s)", "train step", "FAILED (exit 1) (see train.log)"]
    assert rows[2] == ["3. experts", "expert kernels", "not present"]
    assert rows[3] == ["4. context (100 s)", "long context", "TIMEOUT (100 s) (see context.log)"]
    assert rows[4][1:] == ["fp8 index keys: bytes per decode step fp32 / fp8 at 32768", "3.88x fewer"]
    assert rows[5][1:] == ["fp8 index keys: decode step ms at 32768, eager, fp32 / fp8 keys",
                           "10.00 / 12.50 (fp8 / fp32 1.25)"]
    assert rows[6] == ["6. decode (3 s)", "decode", "FAILED (no JSON record in its output)"]
    assert len(rows) == 7


def test_expert_kernel_row_reads_whatever_record_it_gets(tmp_path):
    points = [{"kernel": "grouped", "direction": "forward", "share": 0.25},
              {"kernel": "grouped", "direction": "forward", "share": 0.5},
              {"kernel": "loop", "direction": "backward", "share": 0.125}]
    (tmp_path / "expert_kernels.json").write_text(json.dumps({"points": points}))
    _step(tmp_path, "experts", "ok", json.dumps({"half_peak": {"small|grouped|forward": {"uniform": "256"}}}) + "\n")
    rows = gct.step_rows(tmp_path, "experts")
    assert rows[0] == ("expert kernels: best share of the matmul peak (--quick)",
                       "grouped forward 50%, loop backward 12%")
    assert rows[1] == ("expert kernels: tokens per expert at half the peak (small|grouped|forward)",
                       '{"uniform": "256"}')
    (tmp_path / "expert_kernels.json").unlink()
    _step(tmp_path, "experts", "ok", json.dumps({"something": "else"}) + "\n")
    assert gct.step_rows(tmp_path, "experts") == [("expert kernels", "ran (no points in the record: see experts.log)")]


def test_a_record_missing_a_field_is_said_not_raised(tmp_path):
    _step(tmp_path, "train", "ok", json.dumps({"benchmark": "train_step"}) + "\n")
    [(check, result)] = gct.step_rows(tmp_path, "train")
    assert check == "train step" and result == "ok, output not read: KeyError 'config'"


def test_bad_folder_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="OUTDIR must be a folder"):
        gct.main([str(tmp_path / "absent")])


@pytest.mark.slow  # the whole smoke run: minutes (inductor compiles on the CPU)
def test_cpu_smoke_run_prints_every_row_and_no_failure(tmp_path):
    env = {**os.environ, "GPU_CHECK_CPU_SMOKE": "1", "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=1200)
    table = (tmp_path / "table.md").read_text()
    print(table)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _rows(table)
    steps = [r[0].split(" ")[0] for r in rows if r[0]]
    assert steps == ["1.", "2.", "3.", "4.", "5.", "6."], table
    assert not any(("FAILED" in r[2] or "TIMEOUT" in r[2] or "not read" in r[2]) for r in rows), table
    checks = " ".join(r[1] for r in rows)
    for want in ("CUDA tests", "train step tokens/s eager / compiled", "train step MFU", "prefill 320 s per layer",
                 "decode 320 ms per layer", "fp8 index keys: decode step ms", "decode ctx 320 tok/s"):
        assert want in checks, (want, table)
    assert "skipped" in rows[0][2]  # no CUDA here: the CUDA tests are collected and skipped


def test_the_benchmarks_take_the_gpu_runs_flags():
    """The GPU run's arguments (copied from scripts/gpu_check.sh) parse, so a lent machine's minutes are not spent
    on a usage error; --cases refuses an unknown case and a headline without a case says "not measured"."""
    from tests.conftest import benchmark_module

    ts = benchmark_module("train_step")
    args = ts.parse_args(["--device", "cuda", "--cases", "ours,ours-compiled", "--steps", "2", "--repeats", "3",
                          "--warmup", "1"])
    assert (args.preset, args.case_list, args.batch_size, args.seq_len) == ("small", ["ours", "ours-compiled"], 8, 256)
    with pytest.raises(SystemExit):
        ts.parse_args(["--cases", "ours,mine"])
    res = {k: {"tokens_per_s": t, "mfu": m, "optimizer_share": 0.2} for k, t, m in
           (("ours", 100.0, 0.1), ("ours-compiled", 300.0, 0.3))}
    h = ts.headline(res, ts.GOALS)
    assert h["compile_gain_full"] == 3.0 and h["mfu_compiled"] == 0.3 and h["speedup"] is None
    assert h["met"] == {"speedup": None, "mfu": False, "muon_split_share": False}
    lc = benchmark_module("long_context").parse_args(
        ["--costs", "--device", "cuda", "--mixers", "dsa,dsa_indexcache", "--lengths", "32768,65536,131072",
         "--dense-cap", "65536", "--reference-cap", "0", "--decode-steps", "10", "--json-out", "/tmp/x.json",
         "--png", ""])
    assert lc.mixer_list == ["dense", "dsa", "dsa_indexcache"] and lc.length_list == [32768, 65536, 131072]
    fp8 = benchmark_module("fp8_index_keys")
    a = fp8.parse_args(["--skip-quality", "--device", "cuda", "--decode-context", "32768", "--decode-steps", "20"])
    assert a.modes == ["eager", "compiled"] and a.decode_context == 32768
    with pytest.raises(SystemExit):
        fp8.parse_args(["--device", "cuda"])  # the quality part is CPU only
    d = benchmark_module("decode").parse_args(["--device", "cuda", "--contexts", "4096", "--new-tokens", "64",
                                               "--repeats", "1", "--batches", "16", "--check-tokens", "8"])
    assert d.context_list == [4096] and d.batch_list == [16]
