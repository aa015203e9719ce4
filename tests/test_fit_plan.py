"""Fit verdict (`glm5lab.fit_plan`): whether a training plan fits per GPU, and the smallest plan that does.

On the tiny preset (8 routed experts, top-2, 3 MoE layers) at 32-token sequences in bf16: the non-activation
bytes per GPU are hand-computed from the parameter counts (432,928 parameters; Muon kind 366,080, AdamW 66,848),
the activations recomputed with `glm5lab.activations`; a plan that fits, one that does not with the exact plan
the search picks and every plan before it in the search order shown not to fit; the refusals; the CLI lines.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from glm5lab import ModelConfig
from glm5lab.activations import activations
from glm5lab.deployment import train_bytes
from glm5lab.fit_plan import GIB, candidates, check_gpu_memory, fit_verdict

ACT = {"seq_len": 32, "batch": 1}
LIMIT = 2_100_000  # bytes per GPU


def static_bytes_at_4_gpus() -> int:
    """Weights, gradients (bf16), master weights (fp32), optimizer state per GPU at G = 4, by hand."""
    per_gpu = 432_928 // 4  # 108,232 parameters
    optimizer = 366_080 // 4 * 4 + 66_848 // 4 * 8  # Muon 1 fp32 buffer, AdamW 2
    return per_gpu * (2 + 2 + 4) + optimizer  # 865,856 + 499,776 = 1,365,632


def total(cfg, g, cp, ep, ckpt) -> float:
    """A plan's bytes per GPU recomputed from deployment and activations."""
    a = activations(cfg, **ACT, dtype="bf16", checkpointing=ckpt, cp=cp, ep=ep)
    return train_bytes(cfg, g, "bf16")["total"] + a["total"]


def test_hand_computed_static_bytes():
    assert static_bytes_at_4_gpus() == 1_365_632 == train_bytes(ModelConfig.from_preset("tiny"), 4, "bf16")["total"]


def test_a_plan_that_fits():
    cfg = ModelConfig.from_preset("tiny")
    v = fit_verdict(cfg, gpus=4, ep=2, checkpointing=True, act=ACT, gpu_memory=LIMIT / GIB, dtype="bf16")
    a = activations(cfg, **ACT, dtype="bf16", checkpointing=True, ep=2)
    assert v["fits"] and v["plan"] is v["asked"]
    assert v["asked"]["bytes"]["total"] == static_bytes_at_4_gpus() + a["total"] == 2_062_914 <= LIMIT


def test_a_plan_that_does_not_fit_gets_the_smallest_that_does():
    """From 2 GPUs, ep 2, checkpointing off (5.25 MB): every 2-GPU plan needs more than 2.1 MB (the least, cp 2 with
    checkpointing, 3.30 MB); at 4 GPUs without cp, ep 1 does not fit (checkpointing off or on) nor ep 2 without
    checkpointing; ep 2 with checkpointing does: 4 GPUs, ep 2, checkpointing."""
    cfg = ModelConfig.from_preset("tiny")
    v = fit_verdict(cfg, gpus=2, ep=2, checkpointing=False, act=ACT, gpu_memory=LIMIT / GIB, dtype="bf16")
    assert not v["fits"] and v["asked"]["bytes"]["total"] == total(cfg, 2, 1, 2, False) > LIMIT
    p = v["plan"]
    assert (p["gpus"], p["cp"], p["ep"], p["checkpointing"]) == (4, 1, 2, True)
    assert p["bytes"]["total"] == total(cfg, 4, 1, 2, True) == 2_062_914
    order = list(candidates(cfg, gpus=2, ep=2, seq_len=32))
    before = order[:order.index((4, 1, 2, True))]
    assert before == [(2, 1, 1, False), (2, 1, 1, True), (2, 1, 2, False), (2, 1, 2, True), (2, 2, 1, False),
                      (2, 2, 1, True), (4, 1, 1, False), (4, 1, 1, True), (4, 1, 2, False)]
    assert all(total(cfg, *plan) > LIMIT for plan in before)
    assert total(cfg, 4, 1, 1, True) == static_bytes_at_4_gpus() + 844_770  # the next-smaller plan: 2,210,402


def test_none_up_to_the_cap_names_the_dominant_term():
    cfg = ModelConfig.from_preset("tiny")
    v = fit_verdict(cfg, gpus=1, ep=1, checkpointing=False, act=ACT, gpu_memory=1e-4, dtype="bf16", cap=8)
    assert v["plan"] is None and v["best_at_cap"]["gpus"] == 8
    least = min(total(cfg, *c) for c in candidates(cfg, gpus=8, ep=1, seq_len=32, cap=8) if c[0] == 8)
    assert v["best_at_cap"]["bytes"]["total"] == least


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True])
def test_gpu_memory_refused(value):
    with pytest.raises(ValueError, match="--gpu-memory = .* is not allowed: a finite number > 0"):
        check_gpu_memory(value)


def glm5lab(*args):
    return subprocess.run([sys.executable, "-m", "glm5lab", *args], capture_output=True, text=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""}, timeout=300)


def test_cli_ledger_prints_the_verdict():
    r = glm5lab("ledger", "--preset", "tiny", "--gpus", "2", "--ep", "2", "--mode", "train", "--seq-len", "32",
                "--gpu-memory", repr(LIMIT / GIB))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == (
        f"fit on {LIMIT / GIB:g} GiB GPUs: the plan (--gpus 2 --ep 2) needs 5.01 MiB per GPU: it does not fit. "
        "Smallest plan that fits (fewest GPUs, then no cp, then the smallest ep, then checkpointing off): --gpus 4 --ep 2 "
        "--activation-checkpointing, 1.97 MiB per GPU (weights 0.21 MiB + gradients 0.21 MiB + master weights 0.41 MiB "
        "+ optimizer state 0.48 MiB + activations 0.66 MiB)")


@pytest.mark.parametrize("args, message", [
    (["ledger", "--preset", "tiny", "--gpus", "2", "--ep", "2", "--mode", "train", "--seq-len", "32", "--gpu-memory",
      "0"], "glm5lab ledger: error: --gpu-memory = 0.0 is not allowed: a finite number > 0"),
    (["ledger", "--preset", "tiny", "--gpus", "2", "--ep", "2", "--mode", "train", "--gpu-memory", "80"],
     "glm5lab ledger: error: --gpu-memory = 80.0 is not allowed: only with --gpus, --ep and --mode serve, or --mode "
     "train and --seq-len"),
    (["train", "--recipe", "tiny", "--dry-run", "--gpu-memory", "nan"],
     "glm5lab train: error: --gpu-memory = nan is not allowed: a finite number > 0"),
    (["train", "--recipe", "tiny", "--gpu-memory", "8"],
     "glm5lab train: error: --gpu-memory = 8.0 is not allowed: only with --dry-run"),
])
def test_cli_refusals_are_one_line(args, message):
    r = glm5lab(*args)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.strip() == message


def test_dry_run_prints_the_verdict():
    r = glm5lab("train", "--recipe", "tiny", "--dry-run", "--gpu-memory", "8")
    assert r.returncode == 0, r.stderr
    assert "fit on 8 GiB GPUs: the plan (--nproc 1 --ep 1) needs " in r.stdout and ": it fits" in r.stdout


def test_fit_plan_imports_no_torch():
    subprocess.run([sys.executable, "-c", "import sys, glm5lab.fit_plan; assert 'torch' not in sys.modules"],
                   check=True)
