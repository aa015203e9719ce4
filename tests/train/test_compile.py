"""`glm5lab train --compile`: the compiled training losses equal eager's (dense stage and a DSA
stage, top-k below the sequence length), in one graph each (no graph break); a compiled run's
checkpoints load into an eager model, resume, and train like an eager run (under torchrun, where each block is
compiled: test_scale_torchrun.py).

The default suite compiles with the "aot_eager" backend (dynamo's graph capture and AOTAutograd's
forward/backward split, which is where graph breaks and stale-state bugs would show, without
inductor's C++ build: seconds, not minutes). The inductor check (what `--compile` runs) is
marked slow: 1.5-2.5 min per stage on one CPU thread with an empty inductor cache, ~15 s with a
warm one."""

import copy
import json

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.train import compile as train_compile
from glm5lab.train.compile import CompiledLosses
from glm5lab.train.loop import TrainArgs, train
from glm5lab.train.recipe import TrainHyper
from glm5lab.train.step import optimizer_step, set_trainable
from glm5lab.train.losses import stage_losses
from glm5lab.train.stages import Stage
from tests.train.conftest import metrics_rows, run_args, train_killed_at

COMPILE_TOL = dict(rtol=1e-4, atol=1e-5)
"""fp32 CPU, compiled vs eager, same weights and window. Observed (tiny preset, 2 x 24 tokens):
aot_eager bit-equal; inductor (which reorders and fuses reductions) <= 2e-7 relative on the CE
and MTP losses and 1e-9 absolute on an indexer KL of 4.5e-5 (2e-5 relative: hence atol), <= 7e-8
on any gradient; the small preset in benchmarks/train_step.py: <= 1.1e-6 on the first loss. A
garbled model (layer 1's kv_b_proj rows reversed) moves the first loss by 1.8e-3 (dense) and
3.8e-3 (sparse adaptation) relative: outside."""

SEQ = 24
STAGES = {
    "dense": Stage("dense", 2, 3e-3, SEQ, 2, warmup_steps=1),
    "sparse_adaptation": Stage("sparse_adaptation", 2, 3e-4, SEQ, 2, use_dsa=True, indexer_weight=1.0),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tiny():
    cfg = ModelConfig.from_preset("tiny", vocab_size=320)
    assert cfg.index_topk < SEQ  # DSA selects keys in the sparse stage
    torch.manual_seed(0)
    return GLM5ForCausalLM(cfg).train()


def _close(a, b):
    return torch.isclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                         **COMPILE_TOL).all()


def _assert_same_losses(compiled, eager):
    c, e = compiled.to_log(), eager.to_log()
    assert c.keys() == e.keys()
    for key in c:
        if e[key] is None:
            assert c[key] is None, key
        else:
            as_f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
            torch.testing.assert_close(as_f64(c[key]), as_f64(e[key]), **COMPILE_TOL, msg=key)


def _two_steps(model, losses_fn, stage, windows):
    """Two steps of the loop (losses, then `optimizer_step` with `glm5lab train`'s settings:
    backward, clip, Muon Split, router bias update); returns the StepLosses of each and the
    gradients of the first."""
    set_trainable(model, stage)
    opt = TrainHyper.default().build_optimizer(model, stage.lr)
    grads = {}

    def keep_first_grads(*_):
        if not grads:
            grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    opt.register_step_pre_hook(keep_first_grads)
    out = []
    for step, w in enumerate(windows, start=1):
        losses = losses_fn(w, stage)
        optimizer_step(model, opt, losses, stage, step, TrainHyper.default())
        out.append(losses)
    return out, grads


def _compare(stage_name, backend):
    stage = STAGES[stage_name]
    eager_model = _tiny()
    compiled_model = copy.deepcopy(eager_model)
    windows = torch.randint(0, 320, (2, 2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    compiled = CompiledLosses(compiled_model, backend=backend, fullgraph=True)
    c, c_grads = _two_steps(compiled_model, compiled, stage, windows)
    e, e_grads = _two_steps(eager_model, lambda w, s: stage_losses(eager_model, w, s), stage, windows)
    for step in range(2):  # step 2 runs on weights and router biases the first step updated
        _assert_same_losses(c[step], e[step])
    assert c_grads.keys() == e_grads.keys()
    for name in e_grads:
        torch.testing.assert_close(c_grads[name], e_grads[name], **COMPILE_TOL, msg=name)
    if stage.use_dsa:
        assert e[0].indexer is not None
    garbled = _tiny()  # the initial weights, but one layer's kv_b_proj rows reversed: must fail the bar
    with torch.no_grad():
        kv_b = garbled.model.layers[1].self_attn.kv_b_proj.weight
        kv_b.copy_(kv_b.flip(0))
    assert not _close(stage_losses(garbled, windows[0], stage).total.detach(), e[0].total.detach())


@pytest.mark.parametrize("stage_name", list(STAGES))
def test_compiled_losses_equal_eager_in_one_graph(stage_name):
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("aot_eager")
    _compare(stage_name, backend)
    assert backend.frame_count == 1  # one graph for the stage: compiled (not eager), no graph break


@pytest.mark.slow
@pytest.mark.parametrize("stage_name", list(STAGES))
def test_inductor_losses_equal_eager(stage_name):
    _compare(stage_name, "inductor")


@pytest.mark.slow  # 37 s: a compiled run end to end (the per-stage graph tests above stay in the default suite)
def test_compiled_run_checkpoints_load_into_eager_and_resume(corpus, monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(train_compile, "BACKEND", backend)
    plan = [s.to_dict() for s in STAGES.values()]
    args = lambda out, **kw: TrainArgs(**{**run_args(corpus, out).__dict__, "stage_plan": plan,  # noqa: E731
                                          "checkpoint_every": 2, "eval_every": 2, **kw})
    train(args(corpus / "eager"))
    killed = corpus / "compiled"
    train_killed_at(3, args(killed, compile=True), monkeypatch)
    train(args(killed, compile=True, resume=True))
    assert backend.frame_count >= 2  # both stages ran compiled
    assert json.loads((killed / "run.json").read_text())["args"]["compile"] is True
    a, b = metrics_rows(corpus / "eager"), metrics_rows(killed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("loss", "lm_loss", "indexer_kl", "val_loss"):
        for ra, rb in zip(a, b, strict=True):
            if ra.get(key) is not None:
                assert _close(rb[key], ra[key]), (key, ra["step"], rb[key], ra[key])
    latest = lambda run: run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()  # noqa: E731
    loaded = GLM5ForCausalLM.from_pretrained(latest(killed)).state_dict()
    reference = GLM5ForCausalLM.from_pretrained(latest(corpus / "eager")).state_dict()
    assert loaded.keys() == reference.keys() and not any("_orig_mod" in k for k in loaded)
    for key in reference:
        torch.testing.assert_close(loaded[key], reference[key], **COMPILE_TOL, msg=key)


def test_bad_window_is_a_clear_error():
    compiled = CompiledLosses(_tiny(), backend="eager")
    with pytest.raises(ValueError, match="window must be int64"):
        compiled(torch.zeros(2, 25, dtype=torch.int32), STAGES["dense"])
    with pytest.raises(ValueError, match="sequence length 0 is not allowed"):
        compiled(torch.zeros(2, 1, dtype=torch.int64), STAGES["dense"])


def test_cli_flag_sets_compile():
    from glm5lab.cli import build_parser

    assert build_parser().parse_args(["train", "--compile"]).compile is True
    assert build_parser().parse_args(["train"]).compile is False
