"""Deployment accounts (`glm5lab.deployment`): bytes per GPU for training and serving with expert parallelism.

The optimizer kinds equal what `param_group_table` assigns on the instantiated model; per-GPU
bytes are hand-computed for the tiny preset; the GLM-5 8-GPU serving figures that docs/ledger.md
compares with the published GLM-5-FP8 deployment are pinned; the CLI prints and refuses.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.activations import activations
from glm5lab import ledger as lg
from glm5lab.deployment import check_layout, deployment, optimizer_kinds, param_split, render_deployment


GROUP_CONFIGS = {
    "tiny": lambda: ModelConfig.from_preset("tiny"),
    "tiny-gqa-bias-qknorm-tied": lambda: ModelConfig.from_preset(
        "tiny", attention_types=["gqa"] * 4, index_n_heads=0, index_head_dim=0, use_dsa=False, q_lora_rank=0,
        kv_lora_rank=0, attention_bias=True, use_qk_norm=True, tie_word_embeddings=True),
    "tiny-mla-bias": lambda: ModelConfig.from_preset("tiny", attention_bias=True),
    "tiny-gdn-mixed": lambda: ModelConfig.from_preset("tiny").replace(
        attention_types=["mla", "mla", "gqa", "gqa"], mixer_types=["full", "gdn", "full", "simple_gdn"],
        num_key_value_heads=2),
}


@pytest.mark.parametrize("name", GROUP_CONFIGS)
def test_optimizer_kinds_equal_the_group_table(name):
    from glm5lab.optim.groups import param_group_table

    cfg = GROUP_CONFIGS[name]()
    model = GLM5ForCausalLM(cfg)
    numel = dict(model.named_parameters())
    held = {"muon": 0, "adamw": 0}
    for rule in param_group_table(model, "muon-split"):
        held["adamw" if rule.kind == "adamw" else "muon"] += numel[rule.name].numel()
    assert optimizer_kinds(cfg) == held


def test_tiny_accounts_by_hand():
    cfg = ModelConfig.from_preset("tiny")
    expert = 3 * 64 * 32  # gate, up, down: D x moe_intermediate_size each
    routed = 8 * expert * 4  # 8 experts x (3 sparse main layers + the MTP layer)
    total = lg.conventions(cfg)["with_embeddings_with_mtp"]["total"]  # pinned to the model in test_ledger
    assert param_split(cfg) == {"routed_experts": routed, "non_expert": total - routed, "total": total}
    # AdamW kind: embedding + output 2 x 512 x 64; norms: 4 blocks x 2D + final D + MTP 2D + 3D;
    # MLA q_a / kv_a norms (32 + 32) x 5 layers; indexer k_norm 2 x 16 on the 3 layers holding an indexer
    adamw = 2 * 512 * 64 + (4 * 128 + 64 + 128 + 192) + 64 * 5 + 32 * 3
    assert adamw == 66848 and optimizer_kinds(cfg) == {"muon": total - adamw, "adamw": adamw}

    t = deployment(cfg, gpus=4, ep=2, mode="train", dtype="bf16")
    per_gpu = routed // 4 + -(-(total - routed) // 4)
    assert t["per_gpu_params"] == {"routed_experts": routed // 4, "non_expert": -(-(total - routed) // 4),
                                   "total": per_gpu}
    optimizer = -(-(total - adamw) // 4) * 4 + -(-adamw // 4) * 8
    assert t["per_gpu_bytes"] == {"weights": 2 * per_gpu, "gradients": 2 * per_gpu, "master_weights": 4 * per_gpu,
                                  "optimizer_state": optimizer, "total": 8 * per_gpu + optimizer}
    assert deployment(cfg, gpus=4, ep=2, mode="train", dtype="fp32")["per_gpu_bytes"]["master_weights"] == 0

    s = deployment(cfg, gpus=4, ep=4, mode="serve", dtype="fp8", cache_dtype="bf16", context=100, batch=3)
    weights = routed // 4 + (total - routed)  # fp8: 1 byte each; the rest replicated
    cache = 3 * 100 * (4 * (32 + 8) + 2 * 16) * 2  # 4 MLA layers x 40 values + keys on the 2 own-indexer layers
    assert s["per_gpu_bytes"] == {"weights": weights, "cache": cache, "total": weights + cache,
                                  "mtp_cache": 3 * 100 * (40 + 16) * 2}
    assert s["cache"] == {"dtype": "bf16", "context": 100, "batch": 3}
    a = s["a2a"]  # bf16 payload for fp8 weights: K D b (ep - 1) / ep = 2 x 64 x 2 x 3/4
    assert (a["dtype"], a["dispatch"], a["combine"], a["moe_layers"]) == ("bf16", 192.0, 192.0, 3)
    assert a["forward_per_token"] == 3 * 384 and "forward_backward_per_token" not in a
    per_layer = 2 * 64 * 2 * 1 / 2  # train with ep = 2: K D b (ep - 1) / ep = 128 B each way
    assert t["a2a"]["forward_backward_per_token"] == 2 * t["a2a"]["forward_per_token"] == 2 * 3 * 2 * per_layer
    assert deployment(cfg, gpus=4, ep=4, mode="serve", dtype="bf16")["cache"]["dtype"] == "bf16"  # default: --dtype


def test_glm5_on_8_gpus_serve_figures():
    """The numbers docs/ledger.md compares with the published GLM-5-FP8 8 x H200 deployment."""
    cfg = ModelConfig.from_preset("glm5")
    d = deployment(cfg, gpus=8, ep=8, mode="serve", dtype="fp8", cache_dtype="bf16")
    assert d["params"] == {"routed_experts": 734_439_407_616, "non_expert": 19_424_711_936,
                           "total": 753_864_119_552}
    assert d["per_gpu_bytes"]["weights"] == 734_439_407_616 // 8 + 19_424_711_936 == 111_229_637_888
    assert d["per_gpu_bytes"]["cache"] == 202_752 * 78 * (576 + 128) * 2 == 22_267_035_648
    assert d["experts_per_ep_rank"] == 32 and d["a2a"]["moe_layers"] == 75
    assert json.loads(json.dumps(d)) == d
    text = render_deployment(d)
    assert "103.59 GiB (111.23 GB)" in text and "20.74 GiB (22.27 GB)" in text


@pytest.mark.parametrize("kw, match", [
    ({"gpus": 8, "ep": 3, "mode": "serve"}, r"ep = 3 is not allowed: a divisor of gpus = 8"),
    ({"gpus": 12, "ep": 12, "mode": "serve"}, r"ep = 12 is not allowed: a divisor of the routed experts, "
                                              r"n_routed_experts = 256"),
    ({"gpus": 0, "ep": 1, "mode": "serve"}, r"gpus = 0 is not allowed: an integer >= 1"),
    ({"gpus": 8, "ep": 8, "mode": "infer"}, r"mode = 'infer' is not allowed: one of \('train', 'serve'\)"),
    ({"gpus": 8, "ep": 8, "mode": "train", "dtype": "fp8"}, r"dtype = 'fp8' is not allowed: fp32, bf16 or fp16 with "
                                                             r"mode train"),
    ({"gpus": 8, "ep": 8, "mode": "serve", "batch": 0}, r"batch = 0 is not allowed: an integer >= 1"),
    ({"gpus": 8, "ep": 8, "mode": "serve", "context": 300_000}, r"context 300000 is not allowed"),
])
def test_deployment_refuses_bad_layouts(kw, match):
    with pytest.raises(ValueError, match=match):
        deployment(ModelConfig.from_preset("glm5"), **kw)


def test_ep_without_moe_layers_is_refused():
    dense = ModelConfig.from_preset("tiny", first_k_dense_replace=4)
    with pytest.raises(ValueError, match=r"^--ep = 2 is not allowed: 1 for a model without MoE layers"):
        check_layout(dense, gpus=2, ep=2, mode="serve", flag="--")
    check_layout(dense, gpus=2, ep=1, mode="serve")  # data parallel only: nothing to refuse


def test_check_layout_names_the_flags():
    with pytest.raises(ValueError, match=r"^--ep = 3 is not allowed: a divisor of --gpus = 8"):
        check_layout(ModelConfig.from_preset("glm5"), gpus=8, ep=3, mode="serve", flag="--")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm5lab", "ledger", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_prints_the_serve_accounts_and_json():
    r = run("--preset", "glm5", "--gpus", "8", "--ep", "8", "--mode", "serve", "--dtype", "fp8", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    text = "\n".join(lines[:-1])
    assert lines[0] == ("glm5lab ledger glm5: serve on 8 GPUs, expert parallel 8 (32 routed experts per EP rank "
                        "per MoE layer)")
    assert "weights (fp8, 1 B/value)" in text and "103.59 GiB (111.23 GB)" in text
    # fp8 cache: 576 latent + 128 indexer-key values, 1 B each, + the keys' 4 B fp32 scale, per token per layer
    assert "cache (fp8, main layers, batch 1 x context 202,752)" in text and "10.43 GiB (11.20 GB)" in text
    assert "dispatch 86,016 B + combine 86,016 B; x 75 MoE layers = 12.902 MB per token" in text
    d = json.loads(lines[-1])
    assert d["per_gpu_bytes"]["weights"] == 111_229_637_888 and d["per_gpu_bytes"]["cache"] == 78 * (704 + 4) * 202_752
    assert d["a2a"]["dispatch"] == 86016 and d["mode"] == "serve" and d["sharding"]


def test_cli_prints_the_train_accounts():
    r = run("--preset", "tiny", "--gpus", "4", "--ep", "2", "--mode", "train")
    assert r.returncode == 0, r.stderr
    expected = deployment(ModelConfig.from_preset("tiny"), gpus=4, ep=2, mode="train", name="tiny")
    assert r.stdout.strip() == render_deployment(expected)
    assert "master weights (fp32)" in r.stdout and "with backward" in r.stdout


def test_cli_prints_activations_and_the_total_per_gpu():
    """--seq-len adds a step's activations (glm5lab.activations) and the total per GPU below the unchanged
    accounts; --json carries them."""
    args = ("--preset", "tiny", "--gpus", "8", "--ep", "2", "--mode", "train")
    plain = run(*args).stdout
    r = run(*args, "--seq-len", "64", "--micro-batch", "2", "--cp", "2", "--activation-checkpointing", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "\n".join(lines[:len(plain.strip().splitlines())]) == plain.strip()  # today's accounts, unchanged
    text, d = "\n".join(lines[:-1]), json.loads(lines[-1])
    cfg = ModelConfig.from_preset("tiny")
    a = activations(cfg, seq_len=64, batch=2, dtype="bf16", checkpointing=True, cp=2, ep=2)
    assert d["activations"] == a
    assert d["total_with_activations"] == d["per_gpu_bytes"]["total"] + a["total"]
    assert d["cp_gather"]["total"] == (32 + 8 + 16) * 2 / 2
    assert "micro-batch 2 x 64 tokens, 32 on each of cp 2 ranks" in text and "checkpointing on" in text
    assert "total per GPU (weights, gradients, master, optimizer state, activations)" in text
    assert "latent 40 B + indexer keys 16 B (layers with their own indexer) = 56 B" in text


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8", "--ep", "2", "--mode", "train", "--seq-len", "4096", "--cp", "3"],
     "--cp = 3 is not allowed: a divisor of --gpus / --ep = 8 / 2 = 4 (G = data replicas x cp x ep)"),
    (["--gpus", "8", "--ep", "2", "--mode", "train", "--seq-len", "4094", "--cp", "2"],
     "sequence length 4094 does not split over --cp 2 (head_tail layout): it must be a multiple of 4; choose "
     "seq_len 4092 or 4096"),
    (["--gpus", "8", "--ep", "2", "--mode", "train", "--seq-len", "4094", "--cp", "4", "--cp-layout", "round_robin"],
     "sequence length 4094 does not split over --cp 4 (round_robin layout): it must be a multiple of 4"),
    (["--gpus", "8", "--ep", "2", "--mode", "train", "--seq-len", "4096", "--cp-layout", "round_robin"],
     "--cp-layout = 'round_robin' is not allowed: only with --cp"),
    (["--gpus", "8", "--ep", "2", "--mode", "train", "--seq-len", "10"], "--seq-len = 10 is not allowed: more than 19"),
    (["--gpus", "8", "--ep", "2", "--mode", "train", "--seq-len", "64", "--micro-batch", "0"],
     "--micro-batch = 0 is not allowed: an integer >= 1"),
    (["--gpus", "8", "--ep", "8", "--mode", "serve", "--seq-len", "64"],
     "--seq-len = 64 is not allowed: only with --gpus, --ep and --mode train"),
    (["--gpus", "8", "--ep", "8", "--mode", "train", "--cp", "2"],
     "--cp = 2 is not allowed: only with --gpus, --ep, --mode train and --seq-len"),
    (["--activation-checkpointing"], "--activation-checkpointing = True is not allowed: only with --gpus, --ep"),
    (["--gpus", "8", "--ep", "3", "--mode", "serve"], "--ep = 3 is not allowed: a divisor of --gpus = 8"),
    (["--gpus", "8", "--mode", "serve"], "--ep is missing: --gpus, --ep and --mode go together"),
    (["--gpus", "8", "--ep", "8", "--mode", "infer"], "--mode = 'infer' is not allowed: one of ('train', 'serve')"),
    (["--batch", "2"], "--batch = 2 is not allowed: only with --gpus, --ep and --mode serve"),
    (["--gpus", "8", "--ep", "8", "--mode", "train", "--cache-dtype", "fp8"], "--cache-dtype = 'fp8' is not allowed"),
    (["--gpus", "8", "--ep", "8", "--mode", "train", "--dtype", "fp8"], "--dtype = 'fp8' is not allowed"),
])
def test_cli_refusals_are_one_line_and_exit_2(args, message):
    r = run("--preset", "glm5", *args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("glm5lab ledger: error: ") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr


def test_cli_splits_the_sequence_under_train_s_cp_layout():
    """--cp-layout: the seq-len rule of `glm5lab train --cp-layout` (round_robin splits 4094 over cp 2, head_tail
    does not), with the same accounts (the bytes depend on T / cp, not on which positions a rank holds)."""
    args = ("--preset", "glm5", "--gpus", "8", "--ep", "2", "--mode", "train", "--cp", "2", "--json")
    rr = run(*args, "--seq-len", "4094", "--cp-layout", "round_robin")
    assert rr.returncode == 0, rr.stderr
    assert "(head_tail layout)" in run(*args, "--seq-len", "4094").stderr
    ht, rr4096 = (json.loads(run(*args, "--seq-len", "4096", *x).stdout.splitlines()[-1])
                  for x in ((), ("--cp-layout", "round_robin")))
    assert ht == rr4096


def test_accounts_import_no_torch():
    code = ("import sys, glm5lab.deployment, glm5lab.parallel.alltoall, glm5lab.ledger, glm5lab.activations; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
