"""Seeded CPU training is bit-reproducible (docs/reproducibility.md).

Two runs with one seed end with equal weights, every tensor by `torch.equal`, with 2 threads
(the default on these machines, and the count at which the old gathers raced). The race itself is
timing-dependent (it showed on a busy machine as 3.7e-9 in one expert), so a second test pins
its cause without timing: no step may accumulate into repeated destinations with
`index_put_(accumulate=True)`, the backward of advanced indexing `w[idx]`, which CPU torch runs
with atomic adds in thread order (`aten/src/ATen/native/cpu/IndexKernel.cpp`, float32 above
32768 elements). It fails on the `w[expert_P]` gathers the grouped experts used before.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.hf import read_checkpoint
from glm5lab.model import moe
from glm5lab.train.loop import TrainArgs, train
from glm5lab.train.losses import stage_losses
from glm5lab.train.stages import Stage
from tests.train.conftest import metrics_rows

BATCH, SEQ = 8, 64  # 512 tokens x top-2 over 8 experts: ~128 rows an expert, 2-3 tiles of 64 each


def _plan():
    return [s.to_dict() for s in (
        Stage("dense", 3, 3e-3, SEQ, BATCH, warmup_steps=1),
        Stage("indexer_warmup", 2, 5e-3, SEQ, BATCH, trainable="indexer", lm_weight=0.0, mtp_weights=(0.0,),
              indexer_weight=1.0),
        Stage("sparse_adaptation", 2, 3e-4, SEQ, BATCH, use_dsa=True, indexer_weight=1.0),
    )]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_two_seeded_runs_end_with_bit_identical_weights(corpus, two_threads):
    runs = [corpus / "a", corpus / "b"]
    for run in runs:
        train(TrainArgs(config=str(corpus / "config.json"), data=str(corpus / "texts"), out=str(run), seed=3,
                        progress=False, eval_every=0, checkpoint_every=0, stage_plan=_plan()))
    a, b = (read_checkpoint(run / "model") for run in runs)  # the finished runs' HF folders
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ between two seeded runs, e.g. {differ[:3]}"
    assert [r["loss"] for r in metrics_rows(runs[0])] == [r["loss"] for r in metrics_rows(runs[1])]


class _RepeatedAccumulation(TorchDispatchMode):
    """Records every `index_put(accumulate=True)` whose destinations repeat: (shape, repeats)."""

    OPS = {torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
           torch.ops.aten._index_put_impl_.default}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if func in self.OPS and accumulate and args[0].is_floating_point():
            dest, indices = args[0], [i for i in args[1] if i is not None]
            flat = torch.zeros((), dtype=torch.long)
            for d, i in enumerate(torch.broadcast_tensors(*indices)):
                flat = flat * dest.shape[d] + i
            repeats = flat.numel() - flat.unique().numel()
            if repeats:
                self.seen.append((tuple(dest.shape), repeats))
        return func(*args, **kwargs)


def _accumulations(model) -> list:
    audit = _RepeatedAccumulation()
    for stage in (Stage.from_dict(d) for d in _plan()):
        window = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
        with audit:
            stage_losses(model, window, stage).total.backward()
        model.zero_grad(set_to_none=True)
    return audit.seen


def test_no_training_step_accumulates_in_thread_order():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", vocab_size=320))
    assert _accumulations(model) == []


def test_the_audit_catches_a_gather_by_advanced_indexing(monkeypatch):
    def experts_indexed(x_AD, counts_E, gate_EID, up_EID, down_EDI):  # `experts_gathered` with w[e_A]
        e_A = torch.repeat_interleave(torch.arange(counts_E.shape[0]), counts_E)
        h_AI = F.silu(torch.einsum("ad,aid->ai", x_AD, gate_EID[e_A])) * torch.einsum("ad,aid->ai", x_AD, up_EID[e_A])
        return torch.einsum("ai,adi->ad", h_AI, down_EDI[e_A])

    monkeypatch.setattr(moe, "experts_grouped", experts_indexed)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", vocab_size=320))
    shapes = {shape for shape, _ in _accumulations(model)}
    assert shapes == {(8, 32, 64), (8, 64, 32)}  # the experts' [E, I, D] and [E, D, I], nothing else
