"""Under torchrun (2 processes, gloo on CPU): every rank builds the model on the meta device and draws only its own
shards, as one process's seeded init draws them but from its own generator (FSDP2 alone and with --ep 2), each rank
holding half the parameter elements; and a run with --activation-checkpointing and --ep 2 trains from a shared
checkpoint to one process's losses, gradient norms and router loads; under `-m slow`, so do runs with --compile (per
block; aot_eager and inductor), alone and with --ep 2. (tests/train/test_fsdp.py and test_expert_parallel.py compare
plain FSDP2 and EP runs, also built this way, with one process.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.train.loop import TrainArgs, train
from tests.conftest import free_port
from tests.train.conftest import init_differences, metrics_rows, shared_init, tiny_plan

DRIVER = """
import json, sys
import torch
from glm5lab import ModelConfig
from glm5lab.parallel import dist
from glm5lab.train.loop import TrainArgs, train
out, corpus = sys.argv[1], sys.argv[2]
RUNS = json.loads(sys.argv[3])
cfg = ModelConfig.from_hf(corpus + "/config.json")
ctx = dist.setup()
counts = {}
for ep in (1, 2):
    model = dist.build_meta(cfg)
    assert all(t.is_meta for t in model.state_dict().values())  # the build allocates nothing
    dist.shard_model(model, ctx, ep=ep)
    dist.materialize(model, ctx, 0)
    counts[ep] = {"local": sum(p.to_local().numel() for p in model.parameters()),
                  "total": sum(p.numel() for p in model.parameters())}
    full = dist.full_model(model, ctx)
    if ctx.is_main:
        torch.save(full.state_dict(), f"{out}-init-{ep}.pt")
if ctx.is_main:
    open(out + "-init.json", "w").write(json.dumps(counts))
for name, ep, compile, ac in RUNS:
    train(TrainArgs(init=corpus + "/init", data=corpus + "/texts", out=out + "-" + name, progress=False,
                    eval_every=0, checkpoint_every=0, stage_plan=json.loads(sys.argv[4]), ep=ep,
                    compile=compile, activation_checkpointing=ac, tensorboard=True))
dist.teardown(ctx)  # the init check's group, when no run tore it down
dist.end_process()  # leave as every multi-process run does
"""

RUNS = [("ep-ac", 2, False, True)]
"""(name, --ep, --compile, --activation-checkpointing) of the 2-process runs (compile with AC is refused)."""

SLOW_RUNS = [("compile", 1, True, False), ("ep-compile", 2, True, False)]
"""--compile under torchrun: each block kind, MTP depth length and stage compiles its own graph, and with --ep
dynamo recompiles the expert-parallel frames until the all-to-all sizes become dynamic: many minutes on this
shared 2-core CPU even with aot_eager."""

TOL = 1e-4
"""Relative, fp32: FSDP2 and EP reduce gradients in another order than one process (test_fsdp.py's)."""


def _torchrun(tmp_path, corpus, name, backend, runs=RUNS):
    shared_init(corpus)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "GLM5LAB_COMPILE_BACKEND": backend}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(driver), str(tmp_path / name), str(corpus),
                        json.dumps(runs), json.dumps(tiny_plan(steps=(2, 1, 2), batch=2))],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return tmp_path / name


def _check(out, reference, runs=RUNS):
    torch.manual_seed(0)
    want = GLM5ForCausalLM(ModelConfig.from_hf(out.parent / "config.json")).state_dict()
    for ep, r in json.loads(out.with_name(out.name + "-init.json").read_text()).items():
        assert abs(r["local"] - r["total"] / 2) <= 0.01 * r["total"], (ep, r)  # each rank: half the elements
        got = torch.load(out.with_name(f"{out.name}-init-{ep}.pt"))
        assert init_differences(got, want) == [], ep
        halves = [k for k, w in want.items() if w.shape[0] % 2 == 0 and not bool((w == w.flatten()[0]).all())]
        assert halves and not any(torch.equal(*got[k].chunk(2)) for k in halves), ep  # each rank its own draws
    for name, ep, _, _ in runs:
        _check_run(out.with_name(f"{out.name}-{name}"), reference, ep)


def _check_run(run, reference, ep):
    a, b = metrics_rows(reference), metrics_rows(run)
    assert len(a) == len(b) == 5
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "lm_loss", "indexer_kl", "grad_norm"):
            x, y = ra.get(key), rb.get(key)
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= TOL * max(1.0, abs(x))), (key, ra, rb)
        assert ra["expert_load"] == rb["expert_load"]  # counted once per forward, not again per recomputation
        assert ep == 1 or (rb["ep_tokens"] and rb["a2a_bytes"] > 0)
    assert any((run / "tb").glob("events.out.tfevents.*"))


def _reference(corpus, tmp_path):
    out = tmp_path / "one"
    train(TrainArgs(init=shared_init(corpus), data=str(corpus / "texts"), out=str(out), progress=False,
                    eval_every=0, checkpoint_every=0, stage_plan=tiny_plan(steps=(2, 1, 2), batch=4)))
    return out


def test_sharded_init_and_checkpointed_ep_run_equal_one_process(corpus, tmp_path):
    _check(_torchrun(tmp_path, corpus, "two", "aot_eager"), _reference(corpus, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_blocks_with_ep_and_inductor_equal_one_process(corpus, tmp_path, backend):
    """--compile with --ep (aot_eager), and every run with inductor (what `--compile` runs): minutes here."""
    runs = SLOW_RUNS + (RUNS if backend == "inductor" else [])
    _check(_torchrun(tmp_path, corpus, "two", backend, runs), _reference(corpus, tmp_path), runs)
