"""FSDP2 data parallelism: `torchrun --nproc_per_node=2` (gloo, CPU) trains to the same losses as
one process with the same global batch, both from one checkpoint (`shared_init`; gradient averaging,
rank-sliced batches, gathered Muon updates, sharded checkpoints); so does `--ep 2` (expert parallelism),
whose checkpoint loads in one process and whose metrics.jsonl rows carry the all-to-all figures."""

import json
import os
import subprocess
import sys

from glm5lab import GLM5ForCausalLM
from glm5lab.checkpoints.export import load_checkpoint_model
from tests.conftest import free_port
from tests.train.conftest import logged_losses, shared_init, tiny_plan

DRIVER = """
import json, sys
from glm5lab.parallel.dist import end_process
from glm5lab.train.loop import TrainArgs, train
out, plan = sys.argv[1], json.loads(sys.argv[2])
ep = int(sys.argv[4]) if len(sys.argv) > 4 else 1
train(TrainArgs(init=sys.argv[3] + "/init", data=sys.argv[3] + "/texts", out=out, progress=False,
                eval_every=2, eval_tokens=96, checkpoint_every=0, stage_plan=plan, ep=ep))
end_process()  # leave as every multi-process run does (glm5lab.parallel.dist.end_process)
"""


def test_two_fsdp_processes_match_one_process(corpus, tmp_path):
    shared_init(corpus)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    plan = lambda batch: json.dumps(tiny_plan(steps=(3, 1, 2), batch=batch))  # noqa: E731
    one = subprocess.run([sys.executable, str(driver), str(tmp_path / "one"), plan(4), str(corpus)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    for name, ep in (("two", "1"), ("ep", "2")):
        two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              f"--master_port={free_port()}", str(driver), str(tmp_path / name), plan(2), str(corpus),
                              ep],
                             env=env, capture_output=True, text=True, timeout=300)
        assert two.returncode == 0, two.stderr[-3000:]
    a = logged_losses(tmp_path / "one")
    for run in ("two", "ep"):
        b = logged_losses(tmp_path / run)
        assert len(a) == len(b) == 6
        for row_a, row_b in zip(a, b, strict=True):
            for x, y in zip(row_a, row_b, strict=True):
                assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-4 * max(1.0, abs(x))), (run, a, b)
    _check_ep_run(tmp_path / "ep", tmp_path / "one")
    summary = lambda run: json.loads((run / "summary.json").read_text())  # noqa: E731
    one_s, two_s = summary(tmp_path / "one"), summary(tmp_path / "two")
    assert (one_s["val_tokens"], one_s["val_bytes"]) == (two_s["val_tokens"], two_s["val_bytes"])
    for key in ("val_loss", "val_bits_per_byte"):  # every rank evaluates the whole split
        assert abs(one_s[key] - two_s[key]) <= 1e-4 * one_s[key], (key, one_s[key], two_s[key])
    one_model = GLM5ForCausalLM.from_pretrained(tmp_path / "one" / "checkpoints" / "step-000006").state_dict()
    two_model = load_checkpoint_model(tmp_path / "two" / "checkpoints" / "step-000006").state_dict()  # DCP
    assert max(float((one_model[k] - two_model[k]).abs().max()) for k in one_model) < 1e-4
    tokens = [json.loads(line)["tokens"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert tokens == [2 * 2 * 24] * 6  # global targets a step: 2 processes x batch 2 x seq_len 24
    assert [st["tokens"] for st in two_s["stages"]] == [st["tokens"] for st in one_s["stages"]] == [288, 96, 192]


def _check_ep_run(ep, one):
    """The --ep 2 run's checkpoint loads in one process with the one-process run's weights; each metrics
    row has ep_tokens (rows each EP rank received: per rank a batch of 2 x top-2 rows per position, 24
    positions in each of 3 MoE layers, 23, 22, 21 in the MTP depths), ep_imbalance and a2a_bytes."""
    weights = [load_checkpoint_model(run / "checkpoints" / "step-000006").state_dict() for run in (one, ep)]
    diff = {k: float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]}
    # The indexer warm-up's KL is ~5e-5: its gradient is at rounding-noise scale, and Muon normalises every
    # update to an RMS of lr x 0.2 = 1e-3, so last-bit differences in the hidden states (under EP each
    # expert computes its rows in another batch) turn the indexer's update a little (observed 1.9e-4)
    assert max(v for k, v in diff.items() if ".indexer." in k) < 1e-3
    assert max(v for k, v in diff.items() if ".indexer." not in k) < 1e-4, diff
    rows = [json.loads(line) for line in (ep / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        depths = 1 if r["stage"] == "indexer_warmup" else 3  # the warm-up runs MTP depth 1 only, for its indexer
        per_rank = 2 * 2 * (3 * 24 + sum(23 - j for j in range(depths)))
        assert sum(r["ep_tokens"]) == 2 * per_rank and len(r["ep_tokens"]) == 2, r
        assert r["ep_imbalance"] == max(r["ep_tokens"]) / per_rank
        assert r["ep_token_share"] == [round(n / (2 * per_rank), 4) for n in r["ep_tokens"]]
        assert 0 < r["a2a_bytes"] and r["a2a_bytes"] % (64 * 4) == 0  # whole fp32 rows of width 64
