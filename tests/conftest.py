"""Shared test fixtures and the tolerance table.

Tolerances per dtype, with the observed error that justifies them (tiny preset, 2-core CPU):
- fp32: atol 1e-5 / rtol 1e-5 for two implementations of one layer (observed <= 3e-7);
  1e-4 max-abs on logits against transformers (the issue's bar; observed ~3e-7).
- bf16: atol/rtol 2e-2 (one bf16 rounding is 4e-3 relative; a few accumulate).
Integers (token ids, expert ids, top-k indices) always match exactly.
"""

from __future__ import annotations

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
