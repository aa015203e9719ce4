"""The training run end to end on a tiny model and synthetic text: stages, metrics, checkpoints,
exact resume, divergence handling, MTP overfit, load balancing."""

import json
import math
import os

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.checkpoints.folder import ResumeError
from glm5lab.train.balance import update_router_bias
from glm5lab.train.args import resolve_stages
from glm5lab.train.loop import TrainArgs, _Loop, train
from glm5lab.train.step import TrainingDiverged, clip_and_check
from glm5lab.train.losses import stage_losses
from glm5lab.train.recipe import default_stages
from glm5lab.train.stages import Stage
from tests.train.conftest import metrics_rows, run_args, tiny_plan, train_killed_at


def test_run_writes_metrics_checkpoints_plot_and_summary(corpus):
    run = corpus / "run"
    summary = train(run_args(corpus, run))
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [r["stage"] for r in rows] == ["dense"] * 4 + ["indexer_warmup"] * 2 + ["sparse_adaptation"] * 3
    assert all(math.isfinite(r["loss"]) for r in rows) and all(len(r["mtp_losses"]) == 3 for r in rows[:4])
    assert rows[4]["indexer_kl"] is not None and len(rows[4]["mtp_losses"]) == 1  # MTP run for its indexer
    assert len(rows[0]["expert_load"]) == 4  # 3 MoE layers + the MTP layer
    assert sum(rows[0]["expert_load"][0]) == 2 * 24 * 2  # batch * seq * top-k
    loads = [r["expert_load"] for r in rows]
    for k, r in enumerate(rows):  # the balance figures of each step, from that step's and the window's loads
        assert r["load_max_mean"] == [round(max(x) / (sum(x) / len(x)), 4) for x in r["expert_load"]]
        assert len(r["load_cv"]) == 4 and all(v >= 0 for v in r["load_cv"])
        window = loads[max(0, k + 1 - 20):k + 1]
        assert r["dead_experts"] == [sum(all(step[i][e] == 0 for step in window) for e in range(8)) for i in range(4)]
    assert (run / "loss.png").stat().st_size > 10_000
    assert json.loads((run / "summary.json").read_text())["steps"] == 9
    assert summary["val_loss"] < math.log(320)  # below the uniform guess after 9 steps
    assert_bits_per_byte_recomputed(run, run_args(corpus, run), summary)
    info = json.loads((run / "run.json").read_text())
    assert info["git_commit"] and info["stages"][1]["trainable"] == "indexer"
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    model = GLM5ForCausalLM.from_pretrained(latest)
    assert (latest / "tokenizer.json").is_file() and model.config.vocab_size == 320
    umask = os.umask(0)
    os.umask(umask)
    assert (latest.stat().st_mode & 0o777) == 0o777 & ~umask  # not mkdtemp's 0700
    assert ((latest / "__0_0.distcp").stat().st_mode & 0o777) == 0o666 & ~umask
    served = GLM5ForCausalLM.from_pretrained(run / "model")  # the finished run's HF folder: the last checkpoint's
    assert (run / "model" / "tokenizer.json").is_file() and not (run / "model" / "trainer_state.json").exists()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in served.state_dict().items())


def assert_bits_per_byte_recomputed(run, args: TrainArgs, summary: dict) -> None:
    """summary.json's val_bits_per_byte is val_loss x targets / (ln 2 x bytes), with the targets
    and their bytes recounted from the run's own validation split and tokenizer: the bytes by
    decoding each window's targets (an ASCII corpus: no character is cut at a window edge)."""
    from glm5lab.data.tokenizer import load_tokenizer
    from glm5lab.data.batches import pack
    from tests.conftest import reference_split

    assert json.loads((run / "summary.json").read_text()) == json.loads(json.dumps(summary))
    last = Stage.from_dict(args.stage_plan[-1])
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    tok = load_tokenizer(latest)
    rows = pack(reference_split(tok, args.data, args.seed)[1], last.seq_len)  # every window
    n_tokens = rows[:, 1:].numel()
    n_bytes = sum(len(tok.decode(r[1:].tolist()).encode("utf-8")) for r in rows)
    assert (summary["val_tokens"], summary["val_bytes"]) == (n_tokens, n_bytes)
    expected = summary["val_loss"] * n_tokens / (math.log(2) * n_bytes)
    assert summary["val_bits_per_byte"] == pytest.approx(expected, rel=1e-6)
    assert 0 < summary["val_bits_per_byte"] < 8 * math.log(320) / math.log(256)  # below a uniform guess


def test_evaluate_is_the_mean_over_targets_and_sums_exactly_the_scored_targets():
    """`evaluate_nll(...).loss` is nll_sum / tokens (not the mean of each batch's mean CE, which
    differs with a shorter last batch); nll_sum and the byte count cover the same targets;
    n_windows=None (or more than there are) scores every window."""
    import torch.nn.functional as F
    from tokenizers import Tokenizer, models

    from glm5lab.train.evaluation import Evaluation, evaluate_nll, run_byte_lengths, summary_fields

    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", vocab_size=320))
    windows = torch.randint(0, 320, (7, 17))
    stage = Stage("dense", 1, 1e-3, 16, 3)
    logits = lambda x: model.eval()(x, use_dsa=False).logits.flatten(0, 1)  # noqa: E731
    with torch.no_grad():
        batch_means = torch.stack([F.cross_entropy(logits(windows[i:i + 3, :-1]), windows[i:i + 3, 1:].flatten())
                                   for i in (0, 3, 6)]).mean()
        per_token = F.cross_entropy(logits(windows[:, :-1]), windows[:, 1:].flatten(), reduction="none")
    model.train()
    lengths = torch.arange(320) % 4
    result = evaluate_nll(model, windows, stage, n_windows=9, byte_lengths_V=lengths)
    assert result.loss == pytest.approx(float(per_token.mean()), rel=1e-6)
    assert result.tokens == 7 * 16 and result.utf8_bytes == int(lengths[windows[:, 1:]].sum())
    assert result.nll_sum == pytest.approx(float(per_token.double().sum()), rel=1e-6)
    assert result.loss == result.nll_sum / result.tokens
    assert result.loss != pytest.approx(float(batch_means), rel=1e-6)  # unequal batches: the old mean of means differs
    assert evaluate_nll(model, windows, stage, None, byte_lengths_V=lengths) == result  # every window
    assert result.bits_per_byte == pytest.approx(result.nll_sum / (math.log(2) * result.utf8_bytes), rel=1e-12)
    six = evaluate_nll(model, windows, stage, n_windows=6, byte_lengths_V=lengths)  # 6 rows
    assert six.tokens == 6 * 16 and six.utf8_bytes == int(lengths[windows[:6, 1:]].sum())
    assert model.training
    fields = summary_fields(result)
    assert fields["val_bits_per_byte"] == result.bits_per_byte and fields["val_bytes"] == result.utf8_bytes
    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "▁hello": 1}, unk_token="[UNK]"))
    assert run_byte_lengths(word_level, 320) is None  # not byte-level: no bits per byte, no failed run
    assert summary_fields(Evaluation(2.0, 2)) == {"val_loss": 1.0, "val_perplexity": math.e, "val_tokens": 2}


def test_warmup_trains_only_the_indexer(corpus):
    run = corpus / "run"
    plan = tiny_plan(steps=(2, 2, 1))
    train(TrainArgs(**{**run_args(corpus, run).__dict__, "stage_plan": plan[:1], "checkpoint_every": 0}))
    dense = GLM5ForCausalLM.from_pretrained(run / "checkpoints" / "step-000002").state_dict()
    run2 = corpus / "run2"
    train(TrainArgs(**{**run_args(corpus, run2).__dict__, "init": str(run / "model"),  # the HF folder, tensor by tensor
                       "config": None, "stage_plan": plan[1:2]}))
    warm = GLM5ForCausalLM.from_pretrained(run2 / "checkpoints" / "step-000002").state_dict()
    tok = lambda r: (r / "checkpoints" / "step-000002" / "tokenizer.json").read_bytes()  # noqa: E731
    assert tok(run2) == tok(run)
    for key in dense:
        changed = not torch.equal(dense[key], warm[key])
        assert changed == (".indexer." in key), key  # the MTP layer's (layers.4) indexer included


def test_resume_after_a_kill_reproduces_the_loss_curve_bit_for_bit(corpus, monkeypatch):
    full = corpus / "full"
    train(run_args(corpus, full))
    killed = corpus / "killed"
    train_killed_at(7, run_args(corpus, killed), monkeypatch)
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step-000006"
    train(run_args(corpus, killed, resume=True))
    a, b = metrics_rows(full), metrics_rows(killed)
    assert [r["step"] for r in b] == list(range(1, 10))
    for key in ("loss", "lm_loss", "mtp_losses", "indexer_kl", "grad_norm", "val_loss", "expert_load"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    summary = lambda run: json.loads((run / "summary.json").read_text())  # noqa: E731
    assert summary(killed)["stages"] == summary(full)["stages"]  # the whole history, not just after resume
    assert summary(killed)["val_loss"] == summary(full)["val_loss"]


def test_existing_run_needs_resume_and_resume_needs_a_checkpoint(corpus):
    run = corpus / "run"
    with pytest.raises(ResumeError, match="does not exist: there is nothing to resume"):
        train(run_args(corpus, run, resume=True))
    (run / "checkpoints" / ".step-000001.tmp-dead").mkdir(parents=True)  # killed in its first save
    with pytest.raises(ResumeError, match="no checkpoint in .* stopped before its first one"):
        train(run_args(corpus, run, resume=True))
    train(TrainArgs(**{**run_args(corpus, run).__dict__, "stage_plan": tiny_plan(steps=(1, 1, 1))[:1]}))
    with pytest.raises(FileExistsError, match="holds a finished run .* --out DIR, or remove this one"):
        train(run_args(corpus, run))


def test_init_keeps_the_checkpoint_tokenizer_on_other_data(corpus):
    run = corpus / "run"
    plan = tiny_plan(steps=(2, 1, 1))
    train(TrainArgs(**{**run_args(corpus, run).__dict__, "stage_plan": plan[:1]}))
    other = corpus / "other"
    other.mkdir()
    (other / "a.txt").write_text("completely different words here " * 400)
    (other / "b.txt").write_text("and more unrelated text for a second document " * 300)
    run2 = corpus / "run2"
    train(TrainArgs(**{**run_args(corpus, run2).__dict__, "config": None, "data": str(other), "stage_plan": plan[1:2],
                       "init": str(run / "checkpoints" / "step-000002")}))
    saved = (run / "checkpoints" / "step-000002" / "tokenizer.json").read_bytes()
    assert (run2 / "checkpoints" / "step-000001" / "tokenizer.json").read_bytes() == saved
    run3 = corpus / "run3"  # a run folder as --init: its latest checkpoint
    train(TrainArgs(**{**run_args(corpus, run3).__dict__, "config": None, "stage_plan": plan[1:2], "init": str(run)}))
    info = json.loads((run3 / "run.json").read_text())
    assert info["args"]["init"] == str(run / "checkpoints" / "step-000002")
    from safetensors.torch import load_file, save_file

    from glm5lab.hf import CheckpointError

    weights = run / "model" / "model.safetensors"  # an HF folder whose tensors are not its config's: refused
    tensors = load_file(weights)
    tensors["model.layers.0.extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, weights)
    with pytest.raises(CheckpointError, match=r"1 missing keys: \['model.norm.weight'\]; 1 unexpected keys: "
                       r"\['model.layers.0.extra.weight'\]"):
        train(TrainArgs(**{**run_args(corpus, corpus / "run4").__dict__, "config": None, "stage_plan": plan[1:2],
                           "init": str(run / "model")}))


def test_resume_with_another_model_config_is_refused(corpus):
    run = corpus / "run"
    plan = tiny_plan(steps=(4, 1, 1))[:1]
    real_batch = _Loop.batch

    def dying_batch(self, index, stage, i):
        if self.step == 3:
            raise KeyboardInterrupt
        return real_batch(self, index, stage, i)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Loop, "batch", dying_batch)
        with pytest.raises(KeyboardInterrupt):
            train(TrainArgs(**{**run_args(corpus, run).__dict__, "stage_plan": plan}))
    other = ModelConfig.from_preset("tiny", vocab_size=320, hidden_size=32)
    (corpus / "other.json").write_text(json.dumps(other.to_hf()))
    resume = {**run_args(corpus, run, resume=True).__dict__, "stage_plan": plan}
    with pytest.raises(ValueError, match=r"another model config \(fields \['hidden_size'\] differ\)"):
        train(TrainArgs(**{**resume, "config": str(corpus / "other.json")}))
    bigger = ModelConfig.from_preset("tiny", vocab_size=640)  # checked before the data: not a tokenizer message
    (corpus / "bigger.json").write_text(json.dumps(bigger.to_hf()))
    with pytest.raises(ValueError, match=r"another model config \(fields \['vocab_size'\] differ\)"):
        train(TrainArgs(**{**resume, "config": str(corpus / "bigger.json")}))
    with pytest.raises(ValueError, match=r"--resume: seed differs"):
        train(TrainArgs(**{**resume, "seed": 5}))
    with pytest.raises(ValueError, match=r"--resume: seed differs .*started with$"):  # a longer stage: an extension
        train(TrainArgs(**{**resume, "seed": 5, "stage_plan": tiny_plan(steps=(5, 1, 1))[:1]}))
    train(TrainArgs(**resume))
    with pytest.raises(ValueError, match="already complete"):
        train(TrainArgs(**resume))


def test_nan_stops_the_run_naming_step_and_tensor_and_keeps_the_last_checkpoint(corpus, monkeypatch):
    run = corpus / "run"
    real_batch = _Loop.batch

    def poisoned(self, index, stage, i):
        if self.step == 4:
            with torch.no_grad():
                self.model.model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
        return real_batch(self, index, stage, i)

    monkeypatch.setattr(_Loop, "batch", poisoned)
    with pytest.raises(TrainingDiverged, match=r"step 5: loss is not finite.*`model.layers.1.self_attn.o_proj.weight`"):
        train(run_args(corpus, run))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000004"  # end of the dense stage
    ckpt = GLM5ForCausalLM.from_pretrained(run / "checkpoints" / "step-000004")
    assert all(torch.isfinite(p).all() for p in ckpt.parameters())


def test_nonfinite_gradient_is_named():
    from glm5lab.train.losses import StepLosses

    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model.model.norm.weight.grad[3] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"step 12: non-finite gradient in `model.norm.weight`"):
        clip_and_check(model, StepLosses(torch.tensor(1.0), None, [], None), 12, 1.0)


def test_tiny_overfit_drives_every_mtp_depth_near_zero():
    """Labels are shifted exactly once: on one memorised batch every depth can reach ~0 loss.
    (lr 5e-3: at 1e-2 the LM loss of some seeds still spikes at step 200; 5e-3 reaches ~0.002 on
    every depth for seeds 0-3.)"""
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", index_topk=64)
    model = GLM5ForCausalLM(cfg)
    window = torch.randint(0, 256, (2, 17))
    stage = Stage("dense", 200, 5e-3, 16, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for _ in range(200):
        losses = stage_losses(model, window, stage)
        losses.total.backward()
        opt.step()
        opt.zero_grad()
    assert losses.lm < 0.1 and all(loss < 0.1 for loss in losses.mtp), losses.to_log()


def test_router_bias_moves_toward_underloaded_experts():
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny"))
    moe = model.model.layers[1].mlp
    moe.load = torch.tensor([10, 0, 5, 5, 5, 5, 5, 5])
    loads = update_router_bias(model, rate=0.01)
    bias = moe.gate.e_score_correction_bias
    assert loads[0] == [10, 0, 5, 5, 5, 5, 5, 5] and sum(loads[1]) == 0
    assert bias[0] == pytest.approx(-0.01) and bias[1] == pytest.approx(0.01) and bias[2] == pytest.approx(0.0)
    assert moe.pop_load().sum() == 0


def test_stage_plan_resolution():
    cfg = ModelConfig.from_preset("small")
    stages = resolve_stages(TrainArgs(), cfg)
    assert [s.name for s in stages] == ["dense", "indexer_warmup", "sparse_adaptation"]
    assert stages[1].trainable == "indexer" and not stages[1].use_dsa and stages[2].use_dsa
    assert stages[2].seq_len > cfg.index_topk  # sparse adaptation really is sparse
    assert sum(s.steps for s in resolve_stages(TrainArgs(steps=100), cfg)) == 100
    assert [s.name for s in resolve_stages(TrainArgs(stages=["indexer_warmup", "sparse_adaptation"]), cfg)] == [
        "indexer_warmup", "sparse_adaptation"]
    with pytest.raises(ValueError, match="unknown stage"):
        resolve_stages(TrainArgs(stages=["warmup"]), cfg)
    assert default_stages(quick=True)[0].steps < default_stages()[0].steps
    with pytest.raises(ValueError, match="`trainable` = 'router'"):
        Stage("x", 1, 1e-3, 8, 1, trainable="router")
    assert Stage("x", 10, 1.0, 8, 1, lr_end=0.0, warmup_steps=2).lr_at(1) == 1.0
    assert Stage("x", 10, 1.0, 8, 1, lr_end=0.0, warmup_steps=2).lr_at(9) == 0.0
