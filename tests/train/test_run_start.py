"""A run's start and its way out of trouble: run folder names, refusals before any folder is
made, lengths that cannot carry the stage, data too short, resume from the newest checkpoint that
verifies, the resume and progress lines, the smoothed stage figures and the one validation figure."""

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from glm5lab import ModelConfig
from glm5lab.checkpoints.folder import ResumeError
from glm5lab.cli import build_parser, default_out, main
from glm5lab.train.loop import TrainArgs, progress_text, stage_summary, train
from glm5lab.train.plan import check_data_fits, check_stage_lengths
from glm5lab.train.recipe import default_stages
from glm5lab.train.stages import Stage
from tests.train.conftest import metrics_rows, run_args, tiny_plan


@pytest.mark.parametrize("argv, out", [
    ([], "runs/small"), (["--quick"], "runs/small-quick"), (["--quick", "--steps", "6"], "runs/small-quick-steps6"),
    (["--optimizer", "adamw"], "runs/small-adamw"), (["--preset", "tiny", "--seed", "1"], "runs/tiny-seed1"),
    (["--seq-len", "128", "--bias-update-rate", "0.001"], "runs/small-seq128-bias0.001"),
    (["--config", "a/b/config.json"], "runs/config-b"), (["--config", "my.json"], "runs/config-my"),
    (["--init", "runs/dense/checkpoints/step-000300", "--stages", "indexer_warmup,sparse_adaptation"],
     "runs/init-dense-step-000300-stagesindexer_warmup+sparse_adaptation"),
    (["--eval-every", "10", "--compile", "--no-progress", "--resume"], "runs/small"),  # how, not what: same run
])
def test_default_run_folder_says_what_ran(argv, out):
    assert default_out(build_parser().parse_args(["train", *argv])) == out


def test_default_run_folder_of_data_dot_names_the_folder(tmp_path, monkeypatch):
    (tmp_path / "mytexts").mkdir()
    monkeypatch.chdir(tmp_path / "mytexts")
    assert default_out(build_parser().parse_args(["train", "--data", "."])) == "runs/small-data-mytexts"


def test_failed_starts_leave_no_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    for argv, message in ((["--preset", "nope"], "unknown preset"),
                          (["--bias-update-rate", "-1"], "--bias-update-rate = -1.0 is not allowed"),
                          (["--preset", "tiny", "--seq-len", "3"], "--seq-len 3 is too short for stage 'dense', "
                           "which trains MTP depth 3 (depth j predicts the token j + 1 ahead): it needs --seq-len >= 4"),
                          (["--preset", "tiny", "--seq-len", "5000"], "--seq-len 5000 (stage 'dense') is longer "
                           "than the model's max_position_embeddings 2048: use --seq-len <= 2048"),
                          (["--stages", "dense,nope"], "unknown stage")):
        assert main(["train", "--out", str(out), "--no-progress", *argv]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()


def test_a_run_folder_inside_the_data_folder_is_refused(tmp_path, capsys):
    """--out inside --data (or equal to it) would be read as text by the next run on that data."""
    data = tmp_path / "mydata"
    data.mkdir()
    (data / "a.txt").write_text("some text\n")
    for out in (data, data / "runs" / "x", tmp_path / "mydata" / ".." / "mydata" / "run"):
        assert main(["train", "--preset", "tiny", "--data", str(data), "--out", str(out), "--no-progress"]) == 2
        assert f"--out {out} is inside --data {data}" in capsys.readouterr().err
    assert sorted(p.name for p in data.iterdir()) == ["a.txt"]


def test_a_misspelt_config_field_is_refused_before_any_folder(tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**ModelConfig.from_preset("tiny").to_hf(), "num_expert_per_tok": 2}))
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 2
    assert "`num_expert_per_tok` is unknown (did you mean `num_experts_per_tok`?)" in capsys.readouterr().err
    assert main(["ledger", "--config", str(cfg)]) == 2
    assert "did you mean `num_experts_per_tok`?" in capsys.readouterr().err
    assert not out.exists()


def test_data_too_short_names_data_and_leaves_no_folder(corpus, capsys):
    short = corpus / "short.txt"
    short.write_text("a few words only. " * 3)
    out = corpus / "run"
    rc = main(["train", "--config", str(corpus / "config.json"), "--data", str(short), "--out", str(out),
               "--no-progress", "--tokenizer", str(_tokenizer(corpus)), "--seq-len", "24", "--batch-size", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--data {short}: its training split holds" in err and "give more text" in err, err
    assert not out.exists()


def _tokenizer(corpus):
    """A run's tokenizer.json, so a tiny --data need not train one."""
    run = corpus / "tok-run"
    train(TrainArgs(**{**run_args(corpus, run).__dict__, "stage_plan": tiny_plan(steps=(1, 1, 1))[:1]}))
    return run / "checkpoints" / "step-000001" / "tokenizer.json"


def test_data_fits_checks_every_stage_and_the_held_out_split():
    stages = [Stage("dense", 1, 1e-3, 9, 2), Stage("long", 1, 1e-3, 19, 2)]
    data = SimpleNamespace(source="x.txt", train_tokens=list(range(40)), val_tokens=list(range(15)))
    check_data_fits(data, stages[:1])  # 4 windows of 10 >= batch 2; 15 held-out >= 10
    with pytest.raises(ValueError, match=r"--data x.txt: its training split holds 40 tokens, 2 windows of --seq-len 19 "
                       r"\+ 1; stage 'long' needs a batch of 4 windows \(80 tokens\)"):
        check_data_fits(data, stages, world_size=2)
    with pytest.raises(ValueError, match="held-out split .* holds 15 tokens, fewer than one window of --seq-len 19"):
        check_data_fits(data, stages)
    with pytest.raises(ValueError, match=r"^the default corpus \(x.txt\)"):
        check_data_fits(data, stages, named=False)


def test_lengths_that_cannot_carry_the_stage():
    cfg = ModelConfig.from_preset("tiny")  # MTP, DSA with index_topk 8
    warned = []
    check_stage_lengths(default_stages(seq_len=9), cfg, warned.append)
    assert warned == []
    check_stage_lengths(default_stages(seq_len=8), cfg, warned.append)  # the sparse stage keeps every key
    assert len(warned) == 1 and "--seq-len 8 is not above the model's index_topk 8: in stage 'sparse_adaptation'" in warned[0]
    for seq_len in (1, 3):
        with pytest.raises(ValueError, match=f"--seq-len {seq_len} is too short for stage 'dense'"):
            check_stage_lengths(default_stages(seq_len=seq_len), cfg, warned.append)
    check_stage_lengths(default_stages(seq_len=4), cfg, lambda m: None)  # depth 3 needs 4 inputs
    no_mtp = ModelConfig.from_preset("tiny", num_nextn_predict_layers=0)
    check_stage_lengths(default_stages(seq_len=1, mtp_depth=0), no_mtp, lambda m: None)


def test_stage_summary_smooths_and_reports_validation_at_the_end():
    stage = Stage("dense", 10, 1e-3, 8, 2, mtp_weights=())
    rows = [{"step": i + 1, "stage_step": i + 1, "lm_loss": float(i), "indexer_kl": None} for i in range(10)]
    rows[-1]["val_loss"] = 3.5
    s = stage_summary(stage, rows)
    assert (s["smooth_steps"], s["first"], s["last"], s["val_end"]) == (2, 0.5, 8.5, 3.5)  # a fifth of 10 steps
    long = Stage("long", 300, 1e-3, 8, 2)
    rows = [{"stage_step": i + 1, "lm_loss": float(i)} for i in range(300)]
    s = stage_summary(long, rows)
    assert (s["smooth_steps"], s["first"], s["last"], s["val_end"]) == (20, 9.5, 289.5, None)
    warm = Stage("indexer_warmup", 3, 1e-3, 8, 2, lm_weight=0.0, indexer_weight=1.0)
    s = stage_summary(warm, [{"stage_step": 1, "lm_loss": 9.0, "indexer_kl": 0.25}])
    assert (s["reported"], s["first"], s["tokens"]) == ("indexer_kl", 0.25, 3 * 2 * 8)
    assert stage_summary(warm, [])["first"] is None  # resumed after this stage: records not kept


def test_progress_line_names_lm_loss_objective_and_validation():
    dense, warm, sparse = default_stages()
    record = {"lm_loss": 4.1234, "loss": 8.0123, "tokens_per_s": 912.4}
    val = (50, 4.5678, 128)
    assert progress_text(record, dense, None) == "dense | lm 4.123 | LM+MTP 8.012 | 912 tok/s"
    assert progress_text(record, warm, val) == "indexer_warmup | lm 4.123 | KL 8.012 | 912 tok/s | val 4.568 @50"
    assert progress_text(record, sparse, val).startswith("sparse_adaptation | lm 4.123 | LM+MTP+KL 8.012")
    tiny_kl = {**record, "loss": 5.1e-05}
    assert "| KL 5.1e-05 |" in progress_text(tiny_kl, warm, None)  # 4 significant digits, not 0.000
    plain = Stage("lm", 1, 1e-3, 8, 2, mtp_weights=())
    assert progress_text(record, plain, None) == "lm | lm 4.123 | 912 tok/s"


def test_validation_is_one_definition_headline_and_subset(corpus):
    run = corpus / "run"
    summary = train(run_args(corpus, run))
    rows = metrics_rows(run)
    last = rows[-1]
    assert summary["val_subset_loss"] == last["val_loss"] and summary["val_subset_tokens"] == last["val_tokens"]
    assert last["val_tokens"] == 96  # eval_tokens: 4 windows of 24
    assert summary["val_tokens"] > summary["val_subset_tokens"]  # the whole split: every window
    stages = {s["stage"]: s for s in summary["stages"]}
    assert stages["sparse_adaptation"]["val_end"] == last["val_loss"]
    assert stages["dense"]["smooth_steps"] == 1 and stages["dense"]["first"] == rows[0]["lm_loss"]


def _corrupt(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.mark.parametrize("damaged", ["trainer_state.json", "__0_0.distcp"])
def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(corpus, capsys, damaged):
    run = corpus / "run"
    full = train(run_args(corpus, run))  # 9 steps; checkpoints every 3 steps and at stage ends: keeps 6 and 9
    reference = [r["loss"] for r in metrics_rows(run)]
    (run / "summary.json").unlink()
    latest = run / "checkpoints" / "step-000009"
    _corrupt(latest / damaged)
    (run / "checkpoints" / "latest").write_text("step-000009\n")
    position = json.loads((run / "checkpoints" / "step-000006" / "trainer_state.json").read_text())["position"]
    assert position["step"] == 6
    info = json.loads((run / "run.json").read_text())
    assert info["torch_threads"] == torch.get_num_threads()
    (run / "run.json").write_text(json.dumps({**info, "torch_threads": info["torch_threads"] + 1}))
    summary = train(run_args(corpus, run, resume=True))
    err = capsys.readouterr().err
    assert f"started with {info['torch_threads'] + 1} torch threads and continues with {info['torch_threads']}" in err
    assert f"checkpoint {latest} is unusable" in err and damaged in err
    assert "resuming from step-000006, the newest checkpoint that verifies" in err
    assert "resuming " + str(run) + " from checkpoint step-000006: step 6 of 9, stage sparse_adaptation" in err
    assert [r["loss"] for r in metrics_rows(run)] == reference  # steps 7-9 trained again, bit for bit
    assert summary["val_loss"] == full["val_loss"]


def test_resume_with_every_checkpoint_corrupt_names_each_file(corpus):
    run = corpus / "run"
    train(run_args(corpus, run))
    (run / "summary.json").unlink()  # stopped before its summary: a resume would finish it
    for step in ("step-000006", "step-000009"):
        _corrupt(run / "checkpoints" / step / "rng-00000.pt")
    with pytest.raises(ResumeError, match=r"step-000009: .*rng-00000.pt cannot be read \(truncated or corrupt.*"
                       r"step-000006: .*rng-00000.pt cannot be read"):
        train(run_args(corpus, run, resume=True))


def test_a_checkpoint_of_the_layout_before_dcp_is_refused_by_resume_and_still_read_as_weights(corpus, tmp_path):
    """A step folder of the former one-process layout (an HF folder with trainer_state.pt): --resume refuses it
    naming what still reads it; export and from_pretrained read it as the HF folder it is."""
    from glm5lab import GLM5ForCausalLM
    from glm5lab.checkpoints.export import export_checkpoint

    run = corpus / "run"
    train(TrainArgs(**{**run_args(corpus, run).__dict__, "stage_plan": tiny_plan(steps=(2, 1, 1))[:1]}))
    (run / "summary.json").unlink()
    step = run / "checkpoints" / "step-000002"
    model = GLM5ForCausalLM.from_pretrained(step)
    shutil.rmtree(step)
    model.save_pretrained(step)
    torch.save({"position": {"step": 2, "stage": 1, "in_stage": 0}}, step / "trainer_state.pt")
    with pytest.raises(ResumeError, match=r"step-000002: .*layout before DCP run checkpoints.*--init .*step-000002"):
        train(TrainArgs(**{**run_args(corpus, run, resume=True).__dict__,
                           "stage_plan": tiny_plan(steps=(2, 1, 1))[:1]}))
    out = export_checkpoint(run, tmp_path / "hf")
    again = GLM5ForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())


def test_resume_of_a_finished_run_says_how_to_train_again(corpus):
    run = corpus / "run"
    train(run_args(corpus, run))
    with pytest.raises(ValueError, match="already complete .* choose another --out DIR or remove"):
        train(run_args(corpus, run, resume=True))
    assert math.isfinite(json.loads((run / "summary.json").read_text())["val_loss"])


def test_a_run_killed_in_its_first_save_starts_again_and_stale_temporaries_go(corpus):
    run = corpus / "run"
    (run / "checkpoints" / ".step-000003.tmp-dead").mkdir(parents=True)  # kill -9 while writing step 3
    train(run_args(corpus, run))  # no usable checkpoint: not refused, the run starts over
    assert not list((run / "checkpoints").glob(".step-*")) and (run / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize("change, message", [
    ({"bias_update_rate": 0.0}, "bias_update_rate differs"),
    ({"stage_plan": tiny_plan(steps=(1, 1, 1), seq_len=16)[:1]}, r"stages \(seq_len \[24\] -> \[16\]\) differs"),
])
def test_resume_with_other_settings_is_refused_naming_them(corpus, change, message):
    run = corpus / "run"
    train(TrainArgs(**{**run_args(corpus, run).__dict__, "stage_plan": tiny_plan(steps=(1, 1, 1))[:1]}))
    (run / "summary.json").unlink()
    with pytest.raises(ValueError, match=message):
        train(TrainArgs(**{**run_args(corpus, run, resume=True).__dict__, "stage_plan": tiny_plan(steps=(1, 1, 1))[:1],
                           **change}))
