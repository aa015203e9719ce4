"""Small helpers shared by the benchmarks: timing, matmul peak, output (environment facts: `glm5lab.environment`).

Timing contract: wall-clock seconds from `time.perf_counter`, with the device synchronised
before and after (a no-op on CPU). Cases are timed interleaved (A, B, C, A, B, C, ...) after a
warm-up of each, so a burst of load from other processes on a shared machine hits every case
alike rather than one of them; figures are medians over the repeats.
"""

from __future__ import annotations

import ctypes
import json
import statistics
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


def counting_compile(fn: Callable[[], dict], spent: list[float], key=lambda r: r["stats"]["compile_seconds"]):
    """`fn`, appending each call's compile seconds (`key` of its result) to `spent`: what a
    `time_interleaved` run compiled, its untimed warm-up calls included."""
    def run():
        result = fn()
        spent.append(key(result))
        return result
    return run


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


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def print_json_line(record: dict) -> None:
    """The benchmark's last line: one JSON object (STYLE.md: 'benchmarks print a JSON last line')."""
    print(json.dumps(record, separators=(",", ":")), flush=True)


# --- inference benchmarks (decode.py, prefill.py, speculative.py; their model: the "bench" preset) ---

def resolve_checkpoint(path) -> Path:
    """A model folder from `--model`, as `glm5lab generate --model` resolves it
    (`glm5lab.checkpoints.export.resolve_checkpoint`: a checkpoint folder as is, a run folder through its
    `checkpoints/latest`); a run's `checkpoints/` folder is taken as its run folder. Raises
    SystemExit with what was looked for when there is no model there."""
    from glm5lab.checkpoints.folder import latest_pointer
    from glm5lab.checkpoints.export import resolve_checkpoint as resolve

    p = Path(path)
    if p.name == "checkpoints" and latest_pointer(p.parent) is not None:
        p = p.parent
    try:
        return resolve(p, "--model")
    except ValueError as e:
        raise SystemExit(f"{e}. Train one first: `.venv/bin/glm5lab train --out {p}` (or `--quick` for a "
                         "one-minute model)") from None


def setup_device(args) -> torch.device:
    """The device of `--device` after `--threads`: torch.set_num_threads(args.threads) when given,
    then args.device checked as `glm5lab generate --device` checks it
    (`glm5lab.validate.torch_device`). Raises SystemExit when CUDA is asked for and absent."""
    from glm5lab.validate import torch_device

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return torch_device(args.device, "--device")
    except ValueError as e:
        raise SystemExit(str(e)) from None


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


def load_ours(folder, device, *, dtype: torch.dtype | None = None, mtp: bool | None = None):
    """`GLM5ForCausalLM.from_pretrained(folder, mtp=mtp)` in eval mode (dtype: `model_dtype(device)`)."""
    from glm5lab import GLM5ForCausalLM

    model = GLM5ForCausalLM.from_pretrained(folder, dtype=dtype or model_dtype(device), device=device, mtp=mtp)
    return model.eval()


def weight_bytes_read(model, tokens: int, *, part: str = "main", logits: bool = True) -> float:
    """The weight bytes one cached forward of `tokens` new tokens must read at least (the memory
    bound of decoding), at the model's parameter width: `glm5lab.infer.economics.weight_bytes`
    (part "main": the decoder layers and final norm; "mtp": the MTP layer; the embedding rows of
    the tokens; the expected distinct routed experts per MoE layer, E (1 - (1 - k/E)^tokens); the
    output head when `logits`)."""
    from glm5lab.infer.economics import weight_bytes

    width = next(model.parameters()).element_size()
    return weight_bytes(model.config, tokens, part=part, logits=logits, bytes_per_param=width)


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


def trim_heap(device) -> None:
    """Return freed heap to the OS (glibc malloc_trim; CPU only), so a reused page counts in the next
    `PeakMemory` peak."""
    if torch.device(device).type == "cpu":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass


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
