"""Small helpers shared by the benchmarks: timing, matmul peak, environment facts, output.

Timing contract: wall-clock seconds from `time.perf_counter`, with the device synchronised
before and after (a no-op on CPU). Cases are timed interleaved (A, B, C, A, B, C, ...) after a
warm-up of each, so a burst of load from other processes on a shared machine hits every case
alike rather than one of them; figures are medians over the repeats.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


def sync(device: torch.device | str) -> None:
    """Wait for queued device work (CUDA); nothing to do on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device | str) -> tuple[float, object]:
    """(seconds, fn's result) of one call, the device synchronised on both sides."""
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - t0, result


def time_interleaved(cases: dict[str, Callable[[], object]], *, device, warmup: int,
                     repeats: int) -> dict[str, list[tuple[float, object]]]:
    """Run each case `warmup` times untimed, then `repeats` timed rounds of every case in turn.

    Returns {name: [(seconds, result), ...]} with one entry per repeat, in order."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    out: dict[str, list[tuple[float, object]]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            out[name].append(timed(fn, device))
    return out


def median(xs) -> float:
    return float(statistics.median(xs))


def matmul_case(*, n: int, dtype: torch.dtype, device, calls: int = 4) -> tuple[Callable[[], None], float]:
    """(fn, FLOPs of one fn call): fn runs `calls` [n, n] @ [n, n] `torch.mm` (2 n^3 FLOPs each).

    Meant to be timed alongside the cases it is a ceiling for (`time_interleaved`), in the same
    process and thread count, so it sees the same load: an achieved peak, not a vendor figure."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)

    def fn() -> None:
        for _ in range(calls):
            torch.mm(a, b, out=c)
    return fn, 2.0 * n**3 * calls


def cpu_model() -> str:
    """The 'model name' line of /proc/cpuinfo (else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none): other users' load."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], check=False, capture_output=True, text=True, cwd=repo,
                          timeout=10).stdout.strip()


def git_commit(repo: Path) -> str:
    """HEAD's hash; when tracked files differ from it, "+uncommitted:" and the first 12 hex of
    the sha1 of `git diff HEAD`, so two runs on the same uncommitted tree can be matched."""
    try:
        commit, diff = _git(repo, "rev-parse", "HEAD"), _git(repo, "diff", "HEAD")
        tag = f"+uncommitted:{hashlib.sha1(diff.encode()).hexdigest()[:12]}" if diff else ""
        return (commit or "unknown") + tag
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def env_facts(device) -> dict:
    """What a reader needs to compare a figure with theirs: versions, CPU/GPU, threads, load."""
    facts = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_start": load_average(),
        "git_commit": git_commit(Path(__file__).resolve().parent),
        "device": str(device),
    }
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:
        facts["transformers"] = None
    if torch.device(device).type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def print_json_line(record: dict) -> None:
    """The benchmark's last line: one JSON object (STYLE.md: 'benchmarks print a JSON last line')."""
    print(json.dumps(record, separators=(",", ":")), flush=True)


# --- inference benchmarks (decode.py, prefill.py, speculative.py) ---------------------------------

def bench_config(**overrides):
    """The "wide attention" benchmark model: GLM-5's attention shapes at reduced width, so that
    attention weighs in decode and prefill as it does in the real model (the `small` preset's
    32-wide heads make attention negligible next to the MoE).

    GLM-5's per-head dims (q/k 192 no-RoPE + 64 RoPE, v 256; latent 512 + 64 = 576 cached values
    per token; indexer heads of 128), 8 heads over a 1024 hidden, q latent 768; DSA top-256 with 4
    indexer heads on alternating full/shared layers; 2 layers (dense, then MoE with 8 routed
    experts of 256 top-2 plus a shared one); vocab 4096; one MTP layer; positions up to 16384.
    32.9M parameters in the main model (fp32: 132 MB), 16.6M more in the MTP layer. Built on `ModelConfig.from_preset("small")`, so every
    field not named here is the small preset's (rope_theta 1e4, no bos/eos)."""
    from glm5lab import ModelConfig

    fields = {
        "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 768,
        "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "use_dsa": True, "index_n_heads": 4, "index_head_dim": 128, "index_topk": 256,
        "num_hidden_layers": 2, "indexer_types": ["full", "shared"], "first_k_dense_replace": 1,
        "mlp_layer_types": None, "attention_types": None, "intermediate_size": 1024, "moe_intermediate_size": 256,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "vocab_size": 4096,
        "max_position_embeddings": 16384, "num_nextn_predict_layers": 1,
    }
    fields.update(overrides)
    return ModelConfig.from_preset("small").replace(**fields)


def resolve_checkpoint(path) -> Path:
    """A model folder from `--model`: a folder with config.json and safetensors weights as is; else
    a run folder (whose own config.json has no weights beside it) or its `checkpoints/` folder, resolved through the `latest` pointer `glm5lab train` writes
    (`RUN/checkpoints/latest` holds the name of the newest complete checkpoint).
    Raises SystemExit with what was looked for when there is no model there."""
    p = Path(path)
    if (p / "config.json").is_file() and any(p.glob("*.safetensors*")):
        return p
    for root in (p / "checkpoints", p):
        pointer = root / "latest"
        if pointer.is_file():
            folder = root / pointer.read_text().strip()
            if (folder / "config.json").is_file():
                return folder
            raise SystemExit(f"{pointer} points to {folder}, which holds no config.json (incomplete checkpoint?)")
    raise SystemExit(f"no model at {p}: expected a checkpoint folder (config.json + safetensors) or a run "
                     f"folder with checkpoints/latest. Train one first: `.venv/bin/glm5lab train --out {p}` "
                     f"(or `--quick` for a one-minute model)")


def model_dtype(device) -> torch.dtype:
    """fp32 on CPU, bf16 on CUDA (the benchmarks' convention)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def save_random_model(cfg, folder, *, seed: int = 0) -> Path:
    """Random-init `GLM5ForCausalLM(cfg)` (torch.manual_seed(seed), fp32, CPU) saved with
    `save_pretrained` into `folder`: the one set of weights both ours and transformers load."""
    from glm5lab import GLM5ForCausalLM

    torch.manual_seed(seed)
    model = GLM5ForCausalLM(cfg)
    model.save_pretrained(folder)
    del model
    return Path(folder)


def load_ours(folder, device, *, dtype: torch.dtype | None = None):
    """`GLM5ForCausalLM.from_pretrained(folder)` in eval mode (dtype: `model_dtype(device)`)."""
    from glm5lab import GLM5ForCausalLM

    model = GLM5ForCausalLM.from_pretrained(folder, dtype=dtype or model_dtype(device), device=device)
    return model.eval()


def load_hf_twin(folder, device, *, attn_implementation: str = "eager", dtype: torch.dtype | None = None,
                 **config_overrides):
    """transformers' `GlmMoeDsaForCausalLM.from_pretrained(folder)` (our `save_pretrained` layout:
    the same weights; it drops our MTP layer), eval mode. In transformers 5.24 both "eager" and
    "sdpa" apply the DSA top-k mask (`GlmMoeDsaAttention.forward`: `if _attn_implementation in
    ("eager", "sdpa")`: keys outside the indexer's top-k are masked); other implementations pass
    the indices to a FlashMLA kernel instead."""
    from transformers import GlmMoeDsaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # it reports our MTP layer's weights as unused: expected
    hf_logging.disable_progress_bar()
    hf = GlmMoeDsaForCausalLM.from_pretrained(folder, dtype=dtype or model_dtype(device),
                                              attn_implementation=attn_implementation, **config_overrides)
    return hf.to(device).eval()


def hf_cache_bytes(cache) -> dict:
    """What transformers' cache holds, from its tensors: {"bytes_per_token": per token per row over
    all layers, "tokens": cached tokens, "per_layer": [{name: [shape, bytes per token]}]}.
    transformers 5.24's `DynamicIndexedLayer` stores `keys` = the normed kv latent [B, 1, S, C],
    `values` = the RoPE'd shared key [B, 1, S, R], and on layers with an indexer `indexer_keys`
    [B, S, J] (the latent, not per-head K/V: it re-expands K/V with kv_b_proj every step)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unknown cache type {type(cache).__name__}: no .layers")
    per_layer, total, tokens = [], 0, None
    for layer in layers:
        entry = {}
        for name in ("keys", "values", "indexer_keys"):
            t = getattr(layer, name, None)
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            seq_dim = 1 if name == "indexer_keys" else -2
            B, S = t.shape[0], t.shape[seq_dim]
            per_token = t.numel() * t.element_size() // (B * S)
            entry[name] = [list(t.shape), per_token]
            total += per_token
            tokens = S if tokens is None else tokens
        per_layer.append(entry)
    return {"bytes_per_token": total, "tokens": tokens, "per_layer": per_layer}


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakMemory:
    """The rise of peak memory over a baseline, around one piece of work.

    CPU (Linux): `reset()` writes "5" to /proc/self/clear_refs, which resets the process's peak
    RSS (VmHWM, and with it `getrusage(RUSAGE_SELF).ru_maxrss`) to its current RSS, and records
    that RSS as the baseline; `rise_bytes()` = ru_maxrss (KiB) * 1024 - baseline. Where
    clear_refs cannot be written, the peak is not reset (`reset_ok` False): the rise is then a
    lower bound that hides anything below the process's earlier peak (e.g. model loading).
    CUDA: torch.cuda.reset_peak_memory_stats; rise = max_memory_allocated - memory_allocated at
    reset (tensor memory only, not the allocator's cache)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.baseline, self.reset_ok = 0, False

    @staticmethod
    def rss_bytes() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise OSError("no VmRSS in /proc/self/status")

    def reset(self) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline, self.reset_ok = torch.cuda.memory_allocated(self.device), True
            return
        import gc

        gc.collect()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False
        self.baseline = self.rss_bytes()

    def rise_bytes(self) -> int:
        if self.device.type == "cuda":
            sync(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.baseline


def mib(n_bytes: float | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / 2**20:.0f}"


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"
