"""`glm5lab.tensor_parallel` (the TP serving layout vLLM and SGLang use) and `glm5lab ledger --tp`: per-GPU figures
by hand for the tiny model, GLM-5's TP=8 figure against docs/ledger.md's hand computation, the refusals, and the
plain ledger and EP accounts unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from glm5lab import ModelConfig
from glm5lab.deployment import deployment, param_split, render_deployment
from glm5lab.ledger import ledger, render
from glm5lab.tensor_parallel import check_tp, tp_params, tp_serve


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm5lab", "ledger", *args], capture_output=True, text=True,
                          timeout=120)


def test_tiny_tp_by_hand():
    """tiny: D 64, H 4, q_lora 32, kv_lora 32, rope 8, nope 16, v 16; 4 blocks (1 dense, 3 MoE) + the MTP block;
    indexer (16 heads x 16) on layers 0, 2 and the MTP layer; 8 routed experts of 32, 1 shared; vocab 512."""
    cfg = ModelConfig.from_preset("tiny")
    heads = 32 * 4 * 24 + 32 * 4 * 32 + 4 * 16 * 64  # q_b [Q, H X], kv_b [C, H (nope + v)], o_proj [H v, D]
    a_proj = 64 * 32 + 64 * 40 + 32 + 32  # q_a, kv_a_proj_with_mqa [D, C + R], q_a / kv_a norms
    indexer = 32 * 16 * 16 + 64 * 16 + 64 * 16 + 2 * 16  # wq_b, wk, weights_proj, k_norm (weight + bias)
    expert = 3 * 64 * 32
    whole = {"attention_heads": 5 * heads, "attention_replicated": 5 * a_proj, "indexer": 3 * indexer,
             "dense_ffn": 3 * 64 * 128, "shared_experts": 4 * expert, "routed_experts": 4 * 8 * expert,
             "router": 4 * 8 * 64, "embedding": 512 * 64, "output": 512 * 64,
             "norms": 4 * 128 + 64 + 128 + 192, "eh_proj": 2 * 64 * 64}
    assert tp_params(cfg) == whole and sum(whole.values()) == param_split(cfg)["total"]

    d = tp_serve(cfg, gpus=4, tp=2, ep=2, dtype="bf16", context=100, batch=3)
    held = {**whole, "attention_heads": 5 * heads // 2, "dense_ffn": 3 * 64 * 128 // 2,
            "shared_experts": 4 * expert // 2, "routed_experts": 4 * 8 * expert // 4,  # 2 expert groups x moe-tp 2
            "embedding": 256 * 64, "output": 256 * 64}
    assert d["per_gpu_params"] == {**held, "total": sum(held.values())}
    weights = 2 * sum(held.values())
    cache = 3 * 100 * (4 * (32 + 8) + 2 * 16) * 2  # whole latent (C + R) on 4 MLA layers + keys on 2: not / tp
    assert d["per_gpu_bytes"] == {"weights": weights, "cache": cache, "total": weights + cache,
                                  "mtp_cache": 3 * 100 * (40 + 16) * 2}
    assert (d["replicas"], d["moe_tp"], d["cache"]) == (2, 2, {"dtype": "bf16", "context": 100, "batch": 3})
    # without --ep every expert is split by intermediate size over all G: the same routed / G per GPU
    assert tp_serve(cfg, gpus=4, tp=2, dtype="bf16")["per_gpu_params"]["routed_experts"] == 4 * 8 * expert // 4


def test_glm5_tp8_reproduces_the_docs_hand_figure():
    """docs/ledger.md worked vLLM's TP=8 out by hand: every parameter fp8 / 8 = 94,233,014,944 B, + the parts a
    GPU holds whole (the q_a / kv_a projections the docs add, and here also indexer, router, norms, eh_proj),
    7/8 of each more. Published: "~89 GB per GPU" (GiB, vLLM's unit)."""
    cfg = ModelConfig.from_preset("glm5")
    d = tp_serve(cfg, gpus=8, tp=8, dtype="fp8", cache_dtype="bf16")
    assert param_split(cfg)["total"] == 8 * 94_233_014_944
    whole = tp_params(cfg)
    replicated = sum(whole[k] for k in ("attention_replicated", "indexer", "router", "norms", "eh_proj"))
    assert replicated == 2_210_239_744 and whole["attention_replicated"] == 16_121_856 * 79 + 79 * (2048 + 512)
    weights = d["per_gpu_bytes"]["weights"]
    assert weights == 94_233_014_944 + replicated * 7 // 8 == 96_166_974_720
    assert f"{weights / 2**30:.2f}" == "89.56" and int(weights / 2**30) == 89  # "~89 GB" read as GiB
    assert abs(weights / 2**30 - 89.07) < 0.5  # the docs' hand row (bf16 pieces + block scales, indexer / 8)
    # the cache is not split by heads: each of the 8 GPUs holds the whole 78 x (576 + 128) bf16 values per token
    assert d["per_gpu_bytes"]["cache"] == 78 * 704 * 2 * 202_752


@pytest.mark.parametrize("kw, message", [
    (dict(gpus=6, tp=3), "tp = 3 is not allowed: a divisor of the 64 attention heads"),
    (dict(gpus=12, tp=8), "gpus = 12 is not allowed: a multiple of tp = 8"),
    (dict(gpus=8, tp=8, mode="train"), "tp = 8 is not allowed: only with mode serve"),
    (dict(gpus=16, tp=8, ep=3), "ep = 3 is not allowed: a divisor of gpus = 16"),
    (dict(gpus=8, tp=0), "tp = 0 is not allowed: an integer >= 1"),
])
def test_check_tp_refuses(kw, message):
    with pytest.raises(ValueError, match=message):
        check_tp(ModelConfig.from_preset("glm5"), **kw)


def test_tp_refuses_non_mla_layers():
    cfg = ModelConfig.from_preset("tiny", attention_types=["gqa"] * 4, index_n_heads=0, index_head_dim=0,
                                  use_dsa=False, q_lora_rank=0, kv_lora_rank=0)
    with pytest.raises(ValueError, match="only for models whose every layer is MLA"):
        check_tp(cfg, gpus=2, tp=2)


def test_cli_prints_the_tp_accounts_and_json():
    r = run("--preset", "glm5", "--gpus", "8", "--tp", "8", "--mode", "serve", "--dtype", "fp8", "--cache-dtype",
            "bf16", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    text, d = "\n".join(lines[:-1]), json.loads(lines[-1])
    assert lines[0] == ("glm5lab ledger glm5: serve on 8 GPUs, tensor parallel 8 (1 replica of attention), routed "
                        "experts over ep 1 x MoE tp 8")
    assert "89.56 GiB (96.17 GB)" in text and "20.74 GiB (22.27 GB)" in text
    assert "whole latent on every TP rank, batch 1 x context 202,752" in text
    assert d["per_gpu_bytes"]["weights"] == 96_166_974_720 and d["tp"] == 8


@pytest.mark.parametrize("args, message", [
    (["--gpus", "6", "--tp", "3", "--mode", "serve"], "--tp = 3 is not allowed: a divisor of the 64 attention heads"),
    (["--gpus", "12", "--tp", "8", "--mode", "serve"], "--gpus = 12 is not allowed: a multiple of --tp = 8"),
    (["--gpus", "8", "--tp", "8", "--mode", "train"], "--tp = 8 is not allowed: only with --mode serve"),
    (["--tp", "8", "--mode", "serve"], "--gpus is missing: --tp goes with --gpus and --mode serve"),
])
def test_cli_tp_refusals_are_one_line_and_exit_2(args, message):
    r = run("--preset", "glm5", *args)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr and "Traceback" not in r.stderr


def test_without_tp_the_ledger_prints_what_it_printed():
    """The plain ledger and the EP accounts are what they were: the same text as their renderers give."""
    cfg = ModelConfig.from_preset("tiny")
    assert run("--preset", "tiny").stdout.strip() == render(ledger(cfg, name="tiny"))
    r = run("--preset", "tiny", "--gpus", "4", "--ep", "4", "--mode", "serve")
    assert r.stdout.strip() == render_deployment(deployment(cfg, gpus=4, ep=4, mode="serve", name="tiny"))


def test_tensor_parallel_imports_no_torch():
    code = "import sys, glm5lab.tensor_parallel; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr
