"""Context parallelism (`glm5lab.parallel.context_parallel`): CP 2 and CP 4 under torchrun (gloo, CPU) equal one
process on the same sequences (tests/model/cp_driver.py: logits, DSA top-k exactly, every stage's losses,
gradients and grad norm, weights after 3 steps, gathered bytes against the ledger), and the rules in one process:
the layouts, the mesh rule, the refusals."""

import os
import subprocess
import sys

import pytest
import torch

from glm5lab import GLM5ForCausalLM
from glm5lab.config import ModelConfig
from glm5lab.model.cache import KVCache
from glm5lab.parallel.context_parallel import LAYOUTS, ContextParallel, check_mesh, check_split, positions
from tests.conftest import free_port

DRIVER = os.path.join(os.path.dirname(__file__), "cp_driver.py")


@pytest.mark.parametrize("nproc, layout, T, kind", [(2, "head_tail", 48, "mla"), (4, "round_robin", 48, "mla"),
                                                    (2, "contiguous", 40, "gqa"), (2, "head_tail", 4, "mla")])
def test_cp_equals_one_process(nproc, layout, T, kind):
    """Every rank compares its CP results with one process's (the driver's docstring lists what). T = 4: at MTP
    depth 3 (positions below 1) rank 1 holds no position, an empty [B, 0, ...] forward (was a reshape error)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                          f"--master_port={free_port()}", DRIVER, layout, str(T), kind],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(": ok (") == nproc, run.stdout


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layouts_partition_the_sequence(layout, cp):
    T = 24
    parts = [positions(T, cp, r, layout) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(T))
    assert all(len(p) == T // cp and torch.equal(p, p.sort().values) for p in parts)
    if layout == "head_tail" and cp == 4:
        assert parts[1].tolist() == [3, 4, 5, 18, 19, 20]
    if layout == "head_tail":  # causal pairs: every rank attends to the same number of (query, key) pairs
        assert len({int((p + 1).sum()) for p in parts}) == 1


def test_held_counts_and_local_gather_order():
    cp = ContextParallel(None)
    assert cp.held(16, 13) == [13]
    x = torch.arange(2 * 13 * 3, dtype=torch.float32).view(2, 13, 3)
    assert cp.gather(x, 16, 13) is x
    with pytest.raises(ValueError, match="holds 13 of the positions below 13, got 12 rows"):
        cp.gather(x[:, :12], 16, 13)


def test_split_and_mesh_rules_are_one_line():
    with pytest.raises(ValueError, match=r"sequence length 30 does not split over --cp 4 \(head_tail layout\): it "
                                         r"must be a multiple of 8; choose seq_len 24 or 32"):
        check_split(30, 4)
    with pytest.raises(ValueError, match=r"sequence length 2 does not split over --cp 2 \(head_tail layout\): it "
                                         r"must be a multiple of 4; choose seq_len 4$"):
        check_split(2, 2)  # shorter than one unit: no length 0 offered
    check_split(30, 3, "round_robin")
    assert check_mesh(8, 2, 2) == 2
    with pytest.raises(ValueError, match=r"--cp 4 x --ep 1 = 4 does not divide the run's 6 processes"):
        check_mesh(6, 4, 1)
    with pytest.raises(ValueError, match="context-parallel layout"):
        ContextParallel(None, "zigzag")


def test_a_group_of_one_is_one_process():
    """CP of size 1 takes the CP code path (explicit positions, masks instead of is_causal) and computes the same
    function: logits and every loss within fp32 tolerance, DSA on (top-8 of 40 keys), MTP 3 deep."""
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", use_dsa=True, num_nextn_predict_layers=1))
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        one = model(ids, mtp_depth=3, indexer_loss=True)
        mine = model(ids, mtp_depth=3, indexer_loss=True, context_parallel=ContextParallel(None))
    torch.testing.assert_close(mine.logits, one.logits, atol=2e-5, rtol=0)
    for a, b in zip(mine.mtp_logits, one.mtp_logits, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    torch.testing.assert_close(mine.indexer_loss, one.indexer_loss, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mixer", ["swa", "gdn"])
def test_cp_refuses_layers_it_does_not_split(mixer):
    extra = dict(attention_types=["mla", "mla", "gqa", "gqa"], num_key_value_heads=2) if mixer == "gdn" else \
        dict(sliding_window=8)
    cfg = ModelConfig.from_preset("tiny", mixer_types=["full", "full", mixer, "full"], **extra)
    model = GLM5ForCausalLM(cfg)
    with pytest.raises(ValueError, match=rf"context parallelism runs full-attention MLA and GQA layers only: layer 2 "
                                         rf"is a '{mixer}' layer"):
        model(torch.zeros(1, 16, dtype=torch.long), context_parallel=ContextParallel(None))


def test_cp_refuses_a_cache_logits_to_keep_and_an_unsplittable_length(tiny_model):
    cp = ContextParallel(None, "round_robin")
    cache = KVCache.for_model(tiny_model, batch=1, capacity=32)
    ids = torch.zeros(1, 16, dtype=torch.long)
    for kwargs, got in ((dict(cache=cache), "a cache"), (dict(logits_to_keep=1), "logits_to_keep=1")):
        with pytest.raises(ValueError, match=f"uncached training forwards: got {got}; allowed: no cache, "
                                             r"logits_to_keep=0 \(every position\)$"):
            tiny_model(ids, context_parallel=cp, **kwargs)
    with pytest.raises(TypeError, match="context_parallel must be a .*ContextParallel or None, got str$"):
        tiny_model(ids, context_parallel="cp")
    cp.size = 3  # as a rank of a group of 3 sees it
    with pytest.raises(ValueError, match="sequence length 16 does not split over --cp 3"):
        tiny_model(ids, context_parallel=cp)


@pytest.mark.parametrize("sparse", [False, True])
def test_dense_indexer_kl_in_query_blocks_equals_one_block(monkeypatch, sparse):
    """The warm-up KL of a long sequence runs in checkpointed blocks of queries (`DENSE_KL_BLOCK_ELEMENTS`); here
    forced to blocks of 1-3 queries: the same loss and indexer gradients as one block (the reference path with a
    top-k too)."""
    import glm5lab.model.mla as mla

    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", use_dsa=True, num_nextn_predict_layers=1))
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(3))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(ids, mtp_depth=2, indexer_loss=True, use_dsa=sparse, attn_impl="naive" if sparse else "auto")
        out.indexer_loss.backward()
        return out.indexer_loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, whole_grads = run()
    for elements in (2 * 16 * 37, 3 * 2 * 16 * 37):  # blocks of 1 and 3 queries (B = 2, 16 indexer heads)
        monkeypatch.setattr(mla, "DENSE_KL_BLOCK_ELEMENTS", elements)
        blocked, grads = run()
        torch.testing.assert_close(blocked, whole, atol=1e-7, rtol=1e-5)
        assert grads.keys() == whole_grads.keys() and all(".indexer." in n for n in grads)
        for n in grads:
            torch.testing.assert_close(grads[n], whole_grads[n], atol=1e-7, rtol=1e-4)
