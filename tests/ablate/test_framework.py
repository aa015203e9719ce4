"""The study framework: workbench data (text and task ids disjoint, batches seeded), the in-memory
trainer (loss falls, same seed same weights), the teacher-forced scorers (hand-checked), the
result files and formatting, and the CLI's argument errors."""

import json
import math

import pytest
import torch

from glm5lab import GLM5ForCausalLM
from glm5lab.ablate.fit import fit
from glm5lab.ablate.measure import answer_accuracy, labelled_loss, mqar_accuracy, niah_accuracy, niah_exact_match
from glm5lab.ablate.models import study_config, variant_config
from glm5lab.ablate.results import StudyResult, markdown_table, write_result
from glm5lab.ablate.runner import StudyArgs
from glm5lab.cli import main
from glm5lab.train.stages import Stage


def _small():
    torch.manual_seed(0)
    return GLM5ForCausalLM(study_config(hidden_size=32, num_hidden_layers=1, num_nextn_predict_layers=0, index_topk=4))


def test_text_and_task_ids_are_disjoint_and_batches_are_seeded(bench):
    assert bench.train_tokens.max() < bench.tasks.needle == min(bench.tasks.reserved)
    assert max(bench.tasks.reserved) == bench.vocab_size - 1
    assert set(bench.tasks.filler) == set(range(bench.tasks.needle))
    fn = bench.mixed(16, 4, task_rows=1, num_kv_pairs=2, seed=3)
    stage = Stage("s", 5, 1e-3, 16, 4)
    ids, labels = fn(0, stage, 2)
    assert ids.shape == labels.shape == (4, 16)
    assert torch.equal(ids[:3, 1:], labels[:3, :-1])                 # text rows: next-token targets
    assert (labels[3] != -100).sum() == 2                            # MQAR row: one label per query
    again = bench.mixed(16, 4, task_rows=1, num_kv_pairs=2, seed=3)(0, stage, 2)
    assert torch.equal(again[0], ids) and torch.equal(again[1], labels)
    assert not torch.equal(fn(0, stage, 3)[0], ids)
    with pytest.raises(ValueError, match="task_rows = 5"):
        bench.mixed(16, 4, task_rows=5, num_kv_pairs=2, seed=0)


def test_fit_lowers_the_loss_and_is_reproducible(bench):
    stages = [Stage("a", 12, 1e-2, 16, 4, mtp_weights=())]
    batches = bench.mixed(16, 4, task_rows=0, num_kv_pairs=1, seed=0)
    m1, m2 = _small(), _small()
    r1 = fit(m1, stages, batches, seed=1)
    fit(m2, stages, batches, seed=1)
    assert len(r1) == 12 and r1[-1]["lm_loss"] < r1[0]["lm_loss"] - 0.5
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True))
    assert not m1.training and all(p.requires_grad for p in m1.parameters())


@torch.no_grad()
def test_scorers_agree_with_hand_computation(bench):
    m = _small()
    ids = torch.randint(0, 200, (3, 10), generator=torch.Generator().manual_seed(0))
    pred = m(ids).logits.argmax(-1)
    labels = torch.full_like(ids, -100)
    labels[:, 4], labels[:, 7] = pred[:, 4], pred[:, 7]
    labels[0, 7] = (pred[0, 7] + 1) % 512                            # one wrong answer in row 0
    assert answer_accuracy(m, ids, labels, batch=2) == pytest.approx(5 / 6)
    assert answer_accuracy(m, ids, labels, batch=2, per_row=True) == pytest.approx(2 / 3)
    logp = torch.log_softmax(m(ids).logits, -1)
    mask = labels != -100
    ref = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0][mask].mean()
    assert labelled_loss(m, ids, labels, batch=2) == pytest.approx(float(ref), rel=1e-5)
    assert 0.0 <= mqar_accuracy(m, bench, 6, 32, 4, seed=0) <= 1.0
    assert niah_accuracy(m, bench, 3, 40, seed=0) == 0.0             # an untrained model retrieves nothing


def test_niah_teacher_forcing_equals_greedy_generation(bench):
    from glm5lab import generate
    from glm5lab.evals import make_niah_batch, score_niah

    m = _small()
    examples = make_niah_batch(bench.tasks, 3, 30, seed=1)
    for e in examples:  # make the greedy continuation the canonical completion for rows 0 and 2
        greedy = generate(m, e.prompt, len(e.completion)).tokens[0]
        if e is not examples[1]:
            e.completion[:] = greedy
            e.answers[:] = [greedy[:len(e.answers[0])]]
    acc = niah_exact_match(m, examples)
    gen = [generate(m, e.prompt, len(e.completion)).tokens[0] for e in examples]
    assert acc == pytest.approx(score_niah([[e.completion] for e in examples], gen).mean) == pytest.approx(2 / 3)


def test_variant_configs_follow_the_report_shapes():
    base = study_config()
    gqa, mla, mla256 = (variant_config(base, v) for v in ("gqa-8", "mla", "mla-256"))
    assert gqa.attention_types == ["gqa"] * 4 and gqa.num_key_value_heads == 2 and not gqa.use_dsa
    assert mla.attention_types == ["mla"] * 4 and mla.num_attention_heads == 8
    assert mla256.num_attention_heads == 5 and mla256.v_head_dim == 32 and mla256.qk_nope_head_dim == 24
    with pytest.raises(ValueError, match="variant = 'mqa'"):
        variant_config(base, "mqa")


def test_result_files_and_formatting(tmp_path):
    assert markdown_table(["a", "b"], [[1, 0.12345], ["x", None]]) == "| a | b |\n|---|---|\n| 1 | 0.123 |\n| x | - |\n"

    def plot(path):
        path.write_bytes(b"png")

    res = StudyResult("mla", "| t |\n", {"x": [1.0, math.pi]}, {"steps": 3}, [0, 1], plot, notes=["n1"])
    path = write_result(res, tmp_path / "out", quick=True, elapsed_s=1.234)
    assert path.read_text().startswith("# Ablation `mla` (--quick)") and "- n1" in path.read_text()
    info = json.loads((tmp_path / "out" / "results.json").read_text())
    assert info["seeds"] == [0, 1] and info["raw"]["x"][1] == math.pi and info["elapsed_s"] == 1.2
    assert (tmp_path / "out" / "mla.png").read_bytes() == b"png"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["mla.png", "results.json", "table.md"]


def test_study_args_and_cli_errors_are_clear(tmp_path, capsys):
    assert StudyArgs("dsa", quick=True).out_dir.as_posix() == "runs/ablate/dsa-quick"
    assert StudyArgs("dsa", quick=True, scale="gpu").out_dir.as_posix() == "runs/ablate/dsa-gpu-quick"
    assert [StudyArgs("mla", quick=q, scale=sc).size_key for sc in ("cpu", "gpu") for q in (True, False)] == [
        "quick", "cpu", "gpu-quick", "gpu"]
    with pytest.raises(ValueError, match=r"--scale = 'tpu' is not allowed: one of \('cpu', 'gpu'\)"):
        StudyArgs("mla", scale="tpu")
    with pytest.raises(KeyError, match="has no size 'gpu'"):
        StudyArgs("mla", scale="gpu").size_and_seeds({"quick": 1, "cpu": 2})
    assert StudyArgs("mla", seeds=2).size_and_seeds({"cpu": {"seeds": 3}}) == ({"seeds": 3}, [0, 1])
    assert StudyArgs("mla").size_and_seeds({"cpu": {"seeds": 3}})[1] == [0, 1, 2]
    with pytest.raises(ValueError, match="study 'gqa' is not known"):
        StudyArgs("gqa")
    with pytest.raises(ValueError, match="--seeds = 0"):
        StudyArgs("mla", seeds=0)
    assert main(["ablate", "mla", "--seeds", "0"]) == 2
    assert "--seeds = 0 is not allowed" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert main(["ablate", "swa", "--quick", "--out", str(tmp_path / "f")]) == 2
    assert "is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ablate", "nope"])


def test_a_study_into_a_folder_holding_results_is_refused_before_it_runs(tmp_path, capsys):
    """Re-running a study into an --out that holds results was an overwrite without a word (issue 36, fault 5)."""
    from glm5lab.ablate.runner import check_out

    out = tmp_path / "mla"
    check_out(out)  # missing, empty or holding other files: fine
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    check_out(out)
    (out / "results.json").write_text('{"study": "mla"}')
    assert main(["ablate", "mla", "--quick", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (f"glm5lab ablate: error: --out {out} already holds a study's results (results.json): write this "
                   f"run's into another folder with --out DIR, remove this one (rm -r {out}) to run the study "
                   "again, or add seeds to it with --seeds N (N more than it has)\n")
    assert (out / "results.json").read_text() == '{"study": "mla"}' and sorted(p.name for p in out.iterdir()) == [
        "notes.txt", "results.json"]


def test_studies_state_their_one_difference_from_train():
    """The studies train with `glm5lab train`'s step settings but for the router bias rate, stated
    once (`fit.STUDY_HYPER`); the baseline and optimizer studies' arms use train's own (`fit.TRAIN_HYPER`)."""
    import dataclasses

    from glm5lab.ablate.fit import STUDY_HYPER, TRAIN_HYPER
    from glm5lab.train.recipe import TrainHyper

    assert STUDY_HYPER.bias_update_rate == 1e-3 != TrainHyper.default().bias_update_rate
    assert dataclasses.replace(STUDY_HYPER, bias_update_rate=TrainHyper.default().bias_update_rate) == TrainHyper.default()
    assert TRAIN_HYPER == TrainHyper.default()


def test_a_token_folder_as_study_data_is_refused_in_one_line(tmp_path):
    """A study reads text (it trains its own tokenizer with task ids reserved): a token folder is named and refused,
    not a traceback from inside the workbench (it was `'ShardedTokens' object has no attribute 'astype'`)."""
    from glm5lab.ablate.workbench import Workbench
    from glm5lab.data.tokenize import tokenize_corpus
    from tests.conftest import write_word_corpus

    write_word_corpus(tmp_path / "texts")
    tokenize_corpus(str(tmp_path / "texts"), str(tmp_path / "tokens"), vocab_size=320, progress=False)
    with pytest.raises(ValueError, match=r"is a token folder \(glm5lab tokenize\): a study .* reads text"):
        Workbench.load(data=str(tmp_path / "tokens"))


SLOW_STUDY = """
import sys, time
from glm5lab.ablate import runner, workbench
from glm5lab.cli import main

class Study:
    @staticmethod
    def run(args, bench):
        print("running", flush=True)
        time.sleep(600)

runner.study_module = lambda study: Study
workbench.Workbench.load = staticmethod(lambda data=None: None)
main(["ablate", "swa", "--quick", "--out", sys.argv[1], "--no-progress"])
"""


def test_a_study_holds_its_out_for_its_whole_run(tmp_path, capsys, monkeypatch):
    """The attack pass on issue 36 (finding 5): --out was checked only at the start, so a second study started into
    it while the first ran wrote there too (mla's results plus swa's figure). Now a study holds its --out with
    `glm5lab train`'s lock (`glm5lab.train.run_lock`) until it ends: a second study, or a run, is refused in one
    line naming it; a study that ends leaves only its files."""
    import os
    import subprocess
    import sys

    from glm5lab.ablate import runner, workbench

    def plot(path):
        path.write_bytes(b"png")

    fast = type("Study", (), {"run": staticmethod(lambda args, bench: StudyResult(
        args.study, "| t |\n", {}, {}, [0], plot))})
    monkeypatch.setattr(runner, "study_module", lambda study: fast)
    monkeypatch.setattr(workbench.Workbench, "load", staticmethod(lambda data=None: None))
    out = tmp_path / "x"
    first = subprocess.Popen([sys.executable, "-c", SLOW_STUDY, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert first.stdout.readline() == "running\n"
        capsys.readouterr()
        assert main(["ablate", "mla", "--quick", "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"glm5lab ablate: error: --out {out} is in use by another run (pid {first.pid} on ")
        assert f"{out}); wait for it to end or stop it (kill {first.pid} on " in err and err.count("\n") == 1
        assert main(["train", "--preset", "tiny", "--out", str(out), "--dry-run", "--threads", "1"]) == 2
        assert f"--out {out} is in use by another run (pid {first.pid} on " in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["run.lock"]  # nothing written by the refused ones
    finally:
        first.kill()
        first.wait()
    assert main(["ablate", "mla", "--quick", "--out", str(out), "--no-progress"]) == 0  # the holder is gone
    assert sorted(p.name for p in out.iterdir()) == ["mla.png", "results.json", "table.md"]  # the lock file too
