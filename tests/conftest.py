"""Shared test fixtures and the tolerance table.

Tolerances per dtype, with the observed error that justifies them (tiny preset, 2-core CPU):
- fp32: atol 1e-5 / rtol 1e-5 for two implementations of one layer (observed <= 3e-7);
  1e-4 max-abs on logits against transformers (the issue's bar; observed ~3e-7).
- bf16: atol/rtol 2e-2 (one bf16 rounding is 4e-3 relative; a few accumulate).
Integers (token ids, expert ids, top-k indices) always match exactly.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from glm5lab.threads import configure

configure("pytest", None)  # before torch loads: one thread per CPU other processes leave free (docs/threads.md)

import pytest  # noqa: E402
import torch  # noqa: E402

from glm5lab import GLM5ForCausalLM, ModelConfig  # noqa: E402
from glm5lab.model.rope import rope_angles  # noqa: E402
from glm5lab.model.step import Step  # noqa: E402

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
HF_LOGITS_ATOL = 1e-4
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


WORDS = "the king and queen of denmark speak of love war and the sea while the fool sings".split()


def write_word_corpus(folder, *, docs: int = 6, words_per_doc: int = 1500, words=WORDS, seed: int = 0):
    """`docs` text files doc0.txt.. of `words_per_doc` seeded random words in `folder` (created);
    returns the folder. A corpus for tests that needs no download."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for d in range(docs):
        picked = [words[int(i)] for i in torch.randint(0, len(words), (words_per_doc,), generator=g)]
        (folder / f"doc{d}.txt").write_text(" ".join(picked))
    return folder


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a torchrun --master_port or a spawned gloo group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_close(actual, expected, dtype=torch.float32, **kw):
    torch.testing.assert_close(actual, expected, **{**TOL[dtype], **kw})


def grads(out: torch.Tensor, *inputs: torch.Tensor):
    """Gradients w.r.t. `inputs` of a fixed random projection of `out` (the same projection on
    every call, so two implementations can be compared backward)."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(123)).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)


def uncached_step(cfg: ModelConfig, T: int, **options) -> Step:
    """`Step.uncached` over positions 0..T-1 (RoPE angles of `cfg`) with the config's DSA
    switch and `index_topk` unless `options` override them; `.layer(i)` runs one layer."""
    cos, sin = rope_angles(torch.arange(T), cfg.qk_rope_head_dim, cfg.rope_theta)
    return Step.uncached(T, cos, sin, **{"use_dsa": cfg.use_dsa, "index_topk": cfg.index_topk, **options})


def random_prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    """One seeded random prompt of token ids in [0, vocab) per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def recompute_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The reference: argmax of a full uncached forward over the whole sequence, n times."""
    ids, out = torch.tensor([prompt]), []
    for _ in range(n):
        tok = int(model(ids).logits[0, -1].argmax())
        out.append(tok)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test leaves torch's thread count as it found it: `glm5lab ... --threads N` called through `main()` sets
    it for the whole process, and a later test comparing against a module fixture's run would then reduce in
    another order (run-to-run differences of ~1e-8)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single_thread_no_grad():
    """One torch thread and no autograd for a whole test module (`pytestmark =
    pytest.mark.usefixtures("single_thread_no_grad")`); both restored after it."""
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    yield
    torch.set_grad_enabled(grad)
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return ModelConfig.from_preset("tiny")


@pytest.fixture
def tiny_model(tiny_cfg) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(tiny_cfg)


def encode_whole(tok, docs):
    """int64 ids of `docs` (anything with `.text`), each encoded whole without the tokenizer's special tokens,
    `<|endoftext|>` between two: the reference a token folder's split stream must equal (it encodes in pieces)."""
    import numpy as np

    eot, ids = tok.token_to_id("<|endoftext|>"), []
    for i, enc in enumerate(tok.encode_batch([d.text for d in docs], add_special_tokens=False)):
        ids += ([eot] if i else []) + enc.ids
    return np.array(ids, dtype=np.int64)


def reference_split(tok, data, seed: int = 0, text_field: str = "text"):
    """(train, val) `encode_whole` ids of corpus `data` (None: the default corpus): its documents read whole,
    split by `split_documents` with `seed`."""
    from glm5lab.data.corpus import Document, fetch_default_corpus, split_documents
    from glm5lab.data.sources import open_corpus

    docs = [Document(d.name, d.text) for d in open_corpus(data or fetch_default_corpus(), text_field).documents()]
    return tuple(encode_whole(tok, part) for part in split_documents(docs, seed=seed))


def benchmark_module(name: str):
    """benchmarks/NAME.py loaded as a module (its folder put on sys.path for its own imports)."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def costs_point(T, *, window=2048, swa_ms=2.0, capped=False):
    """A `mixer_costs.costs_point`-shaped entry with hand-set figures: dense state 576 x 4 bytes per token, SWA
    the same width for min(window, T) tokens."""
    keys = ("dense", "swa", "gdn")
    per_token = 576 * 4
    state = {"dense": per_token * T, "swa": per_token * min(window, T), "gdn": 2 * 2**20}
    pre = {k: {"s": 0.01 * T / 1024, "per_layer_s": 0.01 * T / 1024, "cpu_per_layer_s": 0.009 * T / 1024,
               "mixer_per_layer_s": 0.008 * T / 1024, "peak_bytes": 2**20 * T / 1024} for k in keys}
    if capped:
        pre["dense"] = None
    dec = {k: {"s": ms / 1e3, "per_layer_s": ms * 1.5 / 1e3, "cpu_per_layer_s": ms / 1e3, "mixer_per_layer_s": ms / 2e3,
               "cache": "zeros" if capped and k == "dense" else "prefill"}
           for k, ms in (("dense", 0.001 * T), ("swa", swa_ms), ("gdn", 3.0))}
    return {"T": T, "repeats": 1, "prefill": pre, "decode": dec,
            "dense_reference": None if capped else {"s": 0.005 * T / 1024, "cpu_s": 0.004 * T / 1024,
                                                    "mixer_s": 0.003 * T / 1024, "peak_bytes": 2**21},
            "state": {k: {"measured": b, "ledger": b, "measured_per_layer": b, "ledger_per_layer": b}
                      for k, b in state.items()}}


def attention_costs_record() -> dict:
    """A small hand-made record of `benchmarks/long_context.py --costs` (`glm5lab.report.attention_costs`)."""
    costs = benchmark_module("mixer_costs")
    points = [costs_point(8192), costs_point(65536, swa_ms=2.2, capped=True)]
    return {"benchmark": "attention_costs", "command": "benchmarks/long_context.py --costs --lengths 8192,65536",
            "dtype": "float32", "window": 2048, "dense_cap": 16384,
            "mixers": {k: {"label": costs.MIXERS[k]["label"], "layers": 1} for k in ("dense", "swa", "gdn")},
            "points": points, "goals": costs.goals(points, 2048),
            "env": {"date_utc": "2026-12-03 15:00", "git_commit": "0123456789abcdef", "device": "cpu",
                    "torch_threads": 1, "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [2.0, 1.0, 1.0]}}
