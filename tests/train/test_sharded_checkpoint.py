"""Sharded (DCP) checkpoints of distributed runs: each rank writes its shards; a resume at the same world size
continues bit for bit (with and without --ep); a resume at another world size (2 -> 1, 1 -> 2, with and without
--ep) keeps the global batch and continues the uninterrupted run's losses within fp32 rounding; a corrupt
checkpoint falls back to the one before; another model's checkpoint is refused naming the fields.

The reference runs (module fixture, each trained when a test first needs it, 13-25 s on 2 busy cores): 7 steps
of the tiny model over three stages (3 dense, 1 indexer warm-up, 3 sparse), global batch 4 x 24 tokens: "two" (2 processes x 2), "ep" (2 processes
x 2, --ep 2), "one" (1 process x 4). Checkpoints at the stage ends (steps 3, 4, 7; the newest two are kept), so
a cut run resumes from step 4 and trains the sparse stage (DSA top-k, indexer KL, MTP) again."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.checkpoints.folder import ResumeError
from glm5lab.checkpoints.export import load_checkpoint_model
from glm5lab.train.loop import TrainArgs, train
from glm5lab.train.extend import rescale_stages
from glm5lab.train.stages import Stage
from tests.conftest import free_port, write_word_corpus
from tests.train.conftest import metrics_rows, tiny_plan

DRIVER = """
import json, sys
from glm5lab.parallel.dist import end_process
from glm5lab.train.loop import TrainArgs, train
out, plan, corpus, ep, resume = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
train(TrainArgs(config=corpus + "/config.json", data=corpus + "/texts", out=out, progress=False, eval_every=2,
                eval_tokens=48, checkpoint_every=0, stage_plan=plan, ep=ep, resume=resume))
end_process()  # leave as every multi-process run does (glm5lab.parallel.dist.end_process)
"""
LOSS_RTOL = 1e-5
"""Another world size sums the gradients in another order: observed relative loss differences up to 1e-7 (fp32
rounding), and 5e-9 in the validation loss. Garbage check: the steps' losses differ by 1e-2 from one to the next."""


def _run(root, out, *, procs, batch, ep=1, resume=False):
    """The driver in `procs` processes (torchrun with gloo for 2); returns its stderr."""
    root = root.root if isinstance(root, Runs) else root
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "GLM5LAB_CACHE": str(root / "cache")}
    launch = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                  f"--nproc_per_node={procs}", f"--master_port={free_port()}"]
    plan = json.dumps(tiny_plan(steps=(3, 1, 3), batch=batch))
    done = subprocess.run(launch + [str(root / "driver.py"), str(out), plan, str(root), str(ep), str(int(resume))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


class Runs:
    """The corpus, config and driver in `root`, and the reference runs, each trained when first asked for:
    runs["two"] is the folder of the run "two"."""

    PLANS = {"two": {"procs": 2, "batch": 2}, "ep": {"procs": 2, "batch": 2, "ep": 2}, "one": {"procs": 1, "batch": 4}}

    def __init__(self, root):
        self.root = root
        write_word_corpus(root / "texts")
        (root / "config.json").write_text(json.dumps(ModelConfig.from_preset("tiny", vocab_size=320).to_hf()))
        (root / "driver.py").write_text(DRIVER)

    def __truediv__(self, name):
        if name in self.PLANS and not (self.root / name / "summary.json").is_file():
            _run(self.root, self.root / name, **self.PLANS[name])
        return self.root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("sharded"))


def _cut(run, to):
    """A copy of `run` stopped after step 4: no summary, `latest` at step-000004, step 7 gone."""
    shutil.copytree(run, to)
    (to / "summary.json").unlink()
    shutil.rmtree(to / "checkpoints" / "step-000007")
    (to / "checkpoints" / "latest").write_text("step-000004\n")
    return to


def test_each_rank_writes_its_shards_and_the_folder_is_complete(runs):
    folder = runs / "ep" / "checkpoints" / "step-000007"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "config.json", "generation_config.json",
                     "rng-00000.pt", "rng-00001.pt", "tokenizer.json", "tokenizer_config.json", "trainer_state.json"]
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state == {"format": "dcp", "world_size": 2, "ep": 2, "cp": 1, "position": {"step": 7, "stage": 3, "in_stage": 0}}
    assert sorted(p.name for p in (runs / "ep" / "checkpoints").iterdir()) == ["latest", "step-000004", "step-000007"]
    # the experts (E = 4, split by expert over 2 ranks) are not gathered: each rank's file holds about half
    sizes = [(folder / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert max(sizes) < 0.6 * sum(sizes)


@pytest.mark.parametrize("name, ep", [pytest.param("two", 1, marks=pytest.mark.slow), ("ep", 2)])
def test_resume_at_the_same_world_size_is_bit_exact(runs, tmp_path, name, ep):
    cut = _cut(runs / name, tmp_path / "cut")
    err = _run(runs, cut, procs=2, batch=2, ep=ep, resume=True)
    assert "from checkpoint step-000004: step 4 of 7" in err and "resuming at" not in err
    assert metrics_rows(cut) == [{**r, **{k: metrics_rows(cut)[i][k] for k in ("tokens_per_s", "step_time_s")}}
                          for i, r in enumerate(metrics_rows(runs / name))]  # every logged figure but the timings
    a = load_checkpoint_model(runs / name).state_dict()
    b = load_checkpoint_model(cut).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((cut / "summary.json").read_text())["val_loss"] == \
        json.loads((runs / name / "summary.json").read_text())["val_loss"]


@pytest.mark.parametrize("source, procs, batch, ep, notice", [
    pytest.param("two", 1, 2, 1, "resuming at 1 process a run of 2: batch per process 2 -> 4 keeps the global "
                 "batch of 4", marks=pytest.mark.slow),
    ("ep", 1, 2, 1, "resuming at 1 process a run of 2: batch per process 2 -> 4 keeps the global batch of 4"),
    ("one", 2, 4, 2, "resuming at 2 processes a run of 1: batch per process 4 -> 2 keeps the global batch of 4"),
    pytest.param("one", 2, 4, 1, "resuming at 2 processes a run of 1: batch per process 4 -> 2 keeps the global "
                 "batch of 4", marks=pytest.mark.slow),
    pytest.param("ep", 2, 2, 1, None, marks=pytest.mark.slow),  # same processes, without --ep
])
def test_resume_at_another_world_size_keeps_the_global_batch(runs, tmp_path, source, procs, batch, ep, notice):
    """The run resumes with the arguments it started with (--batch-size per process as then); the next
    losses equal the uninterrupted run's within LOSS_RTOL, the summary counts the same tokens."""
    cut = _cut(runs / source, tmp_path / "cut")
    err = _run(runs, cut, procs=procs, batch=batch, ep=ep, resume=True)
    assert (notice in err) if notice else ("resuming at" not in err), err
    started_ep = 2 if source == "ep" else 1  # another --ep is said too, in its own line
    assert (f"resuming with --ep {ep} a run started with --ep {started_ep}: its experts are resharded on load"
            in err) == (ep != started_ep), err
    assert ("a run started with --ep" in err) == (ep != started_ep), err
    ref, got = metrics_rows(runs / source), metrics_rows(cut)
    assert [r["step"] for r in got] == list(range(1, 8)) and got[:4] == ref[:4]
    for a, b in zip(ref[4:], got[4:], strict=True):
        assert b["tokens"] == a["tokens"] == 4 * 24
        for key in ("loss", "lm_loss", "indexer_kl", "val_loss"):
            assert (a.get(key) is None) == (b.get(key) is None), key
            if a.get(key) is not None:
                assert abs(a[key] - b[key]) <= LOSS_RTOL * max(1.0, abs(a[key])), (key, a[key], b[key])
    assert abs(ref[5]["loss"] - ref[6]["loss"]) > 100 * LOSS_RTOL  # the tolerance could tell steps apart
    s_ref, s_got = (json.loads((run / "summary.json").read_text()) for run in (runs / source, cut))
    assert [s["tokens"] for s in s_got["stages"]] == [s["tokens"] for s in s_ref["stages"]] == [288, 96, 288]
    assert abs(s_ref["val_loss"] - s_got["val_loss"]) <= LOSS_RTOL * s_ref["val_loss"]


def _corrupt(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.mark.parametrize("damage", ["__1_0.distcp", pytest.param(".metadata", marks=pytest.mark.slow),
                                    pytest.param("rng-00000.pt", marks=pytest.mark.slow)])
def test_a_corrupt_sharded_checkpoint_falls_back_to_the_one_before(runs, tmp_path, damage):
    """Step 7 damaged (a shard, DCP's metadata or the RNG file rank 0 reads truncated): the
    1-process resume says so and continues from step 4 with the uninterrupted run's losses."""
    run = tmp_path / "run"
    shutil.copytree(runs / "ep", run)
    (run / "summary.json").unlink()
    _corrupt(run / "checkpoints" / "step-000007" / damage)
    err = _run(runs, run, procs=1, batch=2, resume=True)
    assert f"checkpoint {run / 'checkpoints' / 'step-000007'} is unusable" in err and damage in err, err
    assert "resuming from step-000004, the newest checkpoint that verifies" in err
    for a, b in zip(metrics_rows(runs / "ep")[4:], metrics_rows(run)[4:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= LOSS_RTOL * abs(a["loss"])


def _one_process_args(runs, out):
    return TrainArgs(config=str(runs.root / "config.json"), data=str(runs.root / "texts"), out=str(out), progress=False,
                     eval_every=2, eval_tokens=48, checkpoint_every=0, stage_plan=tiny_plan(steps=(3, 1, 3), batch=2),
                     resume=True)


def test_every_sharded_checkpoint_missing_a_file_is_refused_naming_it(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("GLM5LAB_CACHE", str(runs.root / "cache"))
    run = tmp_path / "run"
    shutil.copytree(runs / "ep", run)
    (run / "summary.json").unlink()
    (run / "checkpoints" / "step-000007" / ".metadata").unlink()
    (run / "checkpoints" / "step-000004" / "__0_0.distcp").unlink()
    with pytest.raises(ResumeError, match=r"step-000007: .*incomplete \(missing \.metadata\); step-000004: .*"
                       r"incomplete \(missing __0_0\.distcp\)"):
        train(_one_process_args(runs, run))


def test_a_checkpoint_of_another_model_config_is_refused_naming_the_fields(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("GLM5LAB_CACHE", str(runs.root / "cache"))
    run = tmp_path / "run"
    shutil.copytree(runs / "ep", run)
    (run / "summary.json").unlink()
    path = run / "checkpoints" / "step-000007" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "rms_norm_eps": 1e-3}))
    with pytest.raises(ValueError, match=r"checkpoint .*step-000007 was trained with another model config \(fields "
                       r"\['rms_norm_eps'\] differ\)"):
        train(_one_process_args(runs, run))


def test_rescale_stages_keeps_the_global_batch_by_batch_or_accumulation():
    stages = [Stage("a", 2, 1e-3, 8, 3), Stage("b", 2, 1e-3, 8, 4, grad_accum=2)]
    same, note = rescale_stages(stages, 2, 2)
    assert same == stages and note is None
    down, note = rescale_stages(stages, 2, 1)
    assert [(s.batch_size, s.grad_accum) for s in down] == [(6, 1), (8, 2)]
    assert note == "resuming at 1 process a run of 2: batch per process [3, 4] -> [6, 8] keeps the global batch of [6, 16]"
    up, note = rescale_stages([Stage("a", 2, 1e-3, 8, 3, grad_accum=4)], 2, 4)  # 3 x 2 / 4 no; 4 x 2 / 4 yes
    assert [(s.batch_size, s.grad_accum) for s in up] == [(3, 2)]
    assert note == "resuming at 4 processes a run of 2: gradient accumulation 4 -> 2 keeps the global batch of 24"
    with pytest.raises(ValueError, match=r"stage 'a' has a global batch of 2 processes x batch 3 x grad_accum 1, "
                       r"which 4 processes cannot keep"):
        rescale_stages([Stage("a", 2, 1e-3, 8, 3)], 2, 4)


def test_export_of_a_sharded_checkpoint_gives_the_trained_model_here_and_in_transformers(runs, tmp_path, monkeypatch):
    """The --ep 2 run's DCP checkpoint -> HF shards of at most 300 kB: the tensors `save_pretrained` writes of the
    trained model, read a shard's worth at a time (never the whole model); GLM5ForCausalLM and transformers'
    GlmMoeDsaForCausalLM load it with the trained model's logits."""
    import glm5lab.checkpoints.export
    from glm5lab.checkpoints.export import export_checkpoint
    from glm5lab.hf import load_transformers_twin, read_checkpoint
    from tests.conftest import HF_LOGITS_ATOL

    read_bytes = []
    real = glm5lab.checkpoints.export.read_dcp

    def counting(target, folder, **kw):
        read_bytes.append(sum(t.numel() * t.element_size() for t in target["model"].values()))
        real(target, folder, **kw)

    monkeypatch.setattr(glm5lab.checkpoints.export, "read_dcp", counting)
    out = export_checkpoint(runs / "ep", tmp_path / "out", max_shard_bytes=300_000)
    monkeypatch.setattr(glm5lab.checkpoints.export, "read_dcp", real)
    trained = load_checkpoint_model(runs / "ep" / "checkpoints" / "step-000007")
    trained.save_pretrained(tmp_path / "saved")
    ours, saved = read_checkpoint(out), read_checkpoint(tmp_path / "saved")
    assert ours.keys() == saved.keys() and all(torch.equal(ours[k], saved[k]) for k in ours)
    total = sum(t.numel() * t.element_size() for t in trained.state_dict().values())
    assert len(read_bytes) == len(list(out.glob("model-*.safetensors"))) > 3 and max(read_bytes) < total / 2
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))  # > index_topk 8: DSA on
    with torch.no_grad():
        expected = trained(ids).logits
        assert torch.equal(GLM5ForCausalLM.from_pretrained(out).eval()(ids).logits, expected)
        assert (load_transformers_twin(out)(ids).logits - expected).abs().max() < HF_LOGITS_ATOL
    assert expected.std() > 0.1


def test_from_pretrained_reads_a_sharded_checkpoint(runs):
    """`GLM5ForCausalLM.from_pretrained` of a DCP step folder (what generate, report and --init call): the trained
    weights, whole; mtp=False leaves the MTP layer out; dtype casts all but the fp32-kept tensors."""
    folder = runs / "ep" / "checkpoints" / "step-000007"
    full = GLM5ForCausalLM.from_pretrained(folder).state_dict()
    exported = load_checkpoint_model(runs / "ep").state_dict()
    assert full.keys() == exported.keys() and all(torch.equal(full[k], exported[k]) for k in full)
    assert full["model.mtp_layers.0.eh_proj.weight"].shape == (64, 128)
    plain = GLM5ForCausalLM.from_pretrained(folder, mtp=False, dtype=torch.bfloat16)
    assert plain.config.num_nextn_predict_layers == 0 and not any("mtp" in k for k in plain.state_dict())
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert plain.state_dict()[bias].dtype == torch.float32 and torch.equal(plain.state_dict()[bias], full[bias])
    assert plain.state_dict()["model.embed_tokens.weight"].dtype == torch.bfloat16
    from glm5lab.checkpoints.export import resolve_checkpoint

    assert resolve_checkpoint(str(folder)) == folder and resolve_checkpoint(str(runs / "ep")) == folder
