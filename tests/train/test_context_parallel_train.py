"""`glm5lab train --cp` under torchrun (gloo, CPU) against one process on the same global batch, all from one
checkpoint (`shared_init`): `--cp 2` on 2 processes and `--cp 2 --ep 2` on 4 log the same per-step losses, grad
norms and validation losses and end with the same weights (DSA on: index_topk 8 < seq_len 24; MTP; the indexer
warm-up); each CP row logs what its gathers moved (`cp_gather_bytes`: the dense stage's equal to the ledger's
latent bytes per token, `activations.cp_gather_bytes`); and a `--cp 2` checkpoint resumes in one
process (no --cp: resharded, the same rows a step) to the uninterrupted one-process run's losses and weights."""

import json
import os
import shutil
import subprocess
import sys

from glm5lab import ModelConfig
from glm5lab.activations import cp_gather_bytes
from glm5lab.checkpoints.export import load_checkpoint_model
from glm5lab.parallel.context_parallel import data_rank
from tests.conftest import free_port
from tests.train.conftest import metrics_rows, shared_init, tiny_plan

DRIVER = """
import json, sys
from glm5lab.parallel.dist import end_process
from glm5lab.train.loop import TrainArgs, train
out, plan, root = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
cp, ep, resume, ac = map(int, sys.argv[4:8])
train(TrainArgs(init=root + "/init", data=root + "/texts", out=out, progress=False, eval_every=2, eval_tokens=96,
                checkpoint_every=0, stage_plan=plan, cp=cp, ep=ep, resume=bool(resume), activation_checkpointing=bool(ac)))
end_process()  # leave as every multi-process run does (glm5lab.parallel.dist.end_process)
"""
STEPS = (3, 1, 2)
"""dense 3, indexer warm-up 1, sparse adaptation 2: checkpoints at the stage ends, steps 3, 4 and 6."""
KEYS = ("loss", "lm_loss", "mtp_losses", "indexer_kl", "grad_norm", "val_loss", "tokens")


def _train(tmp_path, corpus, name: str, nproc: int, batch: int, cp: int = 1, ep: int = 1, resume: bool = False,
           ac: bool = False):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    launch = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}"] if nproc > 1 else [sys.executable])
    plan = json.dumps(tiny_plan(steps=STEPS, batch=batch))
    run = subprocess.run([*launch, str(tmp_path / "driver.py"), str(tmp_path / name), plan, str(corpus), str(cp),
                          str(ep), str(int(resume)), str(int(ac))], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp_path / name


def _flat(row: dict) -> list:
    return [x for k in KEYS for x in (row.get(k) if isinstance(row.get(k), list) else [row.get(k)])]


def _same_rows(a: list[dict], b: list[dict], what: str) -> None:
    """Per step: every loss, the grad norm, the validation loss and the tokens within 1e-4 (relative above 1)."""
    assert [r["step"] for r in a] == [r["step"] for r in b], what
    for row_a, row_b in zip(a, b, strict=True):
        for x, y in zip(_flat(row_a), _flat(row_b), strict=True):
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-4 * max(1.0, abs(x))), (what, row_a,
                                                                                                         row_b)


def _same_weights(run_a, run_b, step: int) -> None:
    """The step's checkpoints hold the same weights within 1e-4 (the indexer within 1e-3: its warm-up KL is at
    rounding-noise scale and Muon normalises the update, as tests/train/test_fsdp.py says for --ep)."""
    a, b = (load_checkpoint_model(run / "checkpoints" / f"step-{step:06d}").state_dict() for run in (run_a, run_b))
    diff = {k: float((a[k] - b[k]).abs().max()) for k in a}
    assert max(v for k, v in diff.items() if ".indexer." in k) < 1e-3, diff
    assert max(v for k, v in diff.items() if ".indexer." not in k) < 1e-4, diff


def test_cp_runs_match_one_process_and_resume_in_one(corpus, tmp_path):
    shared_init(corpus)
    (tmp_path / "driver.py").write_text(DRIVER)
    one = _train(tmp_path, corpus, "one", 1, batch=4)
    # one data slice: both ranks read the 4 rows; with activation checkpointing (same losses; the recomputed
    # gathers are not counted again)
    cp2 = _train(tmp_path, corpus, "cp2", 2, batch=4, cp=2, ac=True)
    both = _train(tmp_path, corpus, "cp2ep2", 4, batch=2, cp=2, ep=2)  # two slices of 2 rows, each split over 2
    rows = metrics_rows(one)
    assert len(rows) == sum(STEPS) and all(r["tokens"] == 4 * 24 for r in rows)
    for run in (cp2, both):
        _same_rows(rows, metrics_rows(run), run.name)
        _same_weights(one, run, sum(STEPS))
        assert all(r["cp_gather_bytes"] > 0 for r in metrics_rows(run)), run.name
        summary = [json.loads((r / "summary.json").read_text()) for r in (one, run)]
        assert summary[0]["val_tokens"] == summary[1]["val_tokens"]
        assert abs(summary[0]["val_loss"] - summary[1]["val_loss"]) <= 1e-4 * summary[0]["val_loss"]
        info = json.loads((run / "run.json").read_text())
        world = 4 if run == both else 2
        assert (info["args"]["cp"], info["args"]["cp_layout"], info["world_size"]) == (2, "head_tail", world)
    # the same figure every step of a stage (same shapes, same gathers), summed over the ranks: 4 ranks of 2 rows
    # gather as much as 2 ranks of 4 rows
    per_stage = {r["stage"]: r["cp_gather_bytes"] for r in metrics_rows(cp2)}
    # the dense stage gathers the latents only (no indexer runs): 4 layers and the MTP layer at depths 1-3, each
    # rank receiving the other's 4 x 12 tokens (the MTP depths too: head_tail puts positions 6-17 on rank 1, so its
    # count below T - j stays 12 and rank 0's is padded to it), on 2 ranks
    cfg = ModelConfig.from_hf(corpus / "config.json")
    assert per_stage["dense"] == 2 * (4 + 3) * 4 * 24 * cp_gather_bytes(cfg, 2, dtype="fp32")["latent"] == 107_520
    assert [r["cp_gather_bytes"] for r in metrics_rows(cp2)] == [per_stage[r["stage"]] for r in metrics_rows(cp2)]
    assert [r["cp_gather_bytes"] for r in metrics_rows(both)] == [r["cp_gather_bytes"] for r in metrics_rows(cp2)]
    # resume the --cp 2 run from its step-4 checkpoint in one process: steps 5 and 6 as the one-process run
    resumed = tmp_path / "resumed"
    shutil.copytree(cp2, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    (resumed / "checkpoints" / "latest").write_text("step-000004\n")
    (resumed / "summary.json").unlink()
    _train(tmp_path, corpus, "resumed", 1, batch=4, resume=True)
    after = metrics_rows(resumed)
    assert [r["step"] for r in after] == list(range(1, sum(STEPS) + 1))
    assert all("cp_gather_bytes" not in r for r in after[4:])
    _same_rows(rows[4:], after[4:], "resumed")
    _same_weights(one, resumed, sum(STEPS))


def test_a_cp_group_reads_one_data_slice():
    """World rank r of a dp x cp x ep mesh (expert innermost) reads slice (r // (cp ep)) ep + r % ep of world / cp:
    the cp ranks of a group (ep apart) share one, the ep ranks of a replica read their own."""
    assert [data_rank(r, 2, 1) for r in range(4)] == [0, 0, 1, 1]
    assert [data_rank(r, 2, 2) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [data_rank(r, 1, 2) for r in range(4)] == [0, 1, 2, 3]  # no CP: every rank its own, as before
    assert [data_rank(r, 4, 1) for r in range(4)] == [0, 0, 0, 0]
