"""`glm5lab ablate swa --quick` writes its folder with the report's figures beside ours; the
shared base helpers build a DSA-free GQA model and mixed text / MQAR / NIAH batches."""

import json
import math

import torch

from glm5lab.ablate import report_figures as rf
from glm5lab.ablate.runner import StudyArgs, run_study
from glm5lab.ablate.gqa_base import SIZES, base_config, task_batches
from glm5lab.ablate.study_swa import VARIANTS
from glm5lab.evals.mqar import IGNORE_INDEX
from glm5lab.train.stages import Stage

QUICK = SIZES["quick"]


def test_swa_quick_writes_table_raw_numbers_and_plot(tmp_path, study_corpus):
    path, table = run_study(StudyArgs("swa", quick=True, out=str(tmp_path), progress=False,
                                      data=str(study_corpus)))
    assert path == tmp_path / "table.md" and (tmp_path / "swa.png").stat().st_size > 0
    for v in VARIANTS:
        assert f"| {v} |" in table
        assert all(f"{x:.3f}" in table for x in rf.SWA[v])
    assert "paired [95% t]: verdict" in table and "Searched patterns" in table
    info = json.loads((tmp_path / "results.json").read_text())
    assert info["seeds"] == [0] and info["quick"] is True
    for v in VARIANTS:
        for n in QUICK["lengths"]:
            row = info["raw"][v]["0"][str(n)]
            assert 0 <= row["mqar"] <= 1 and 0 <= row["niah"] <= 1
            assert math.isclose(row["score"], 50 * (row["mqar"] + row["niah"]))
    searched = info["settings"]["patterns"]["searched SWA"]["0"]["mixer_types"]
    assert searched.count("swa") == QUICK["layers"] // 2
    # within the window no pattern changes anything: every variant scores as full
    w = str(QUICK["window"])
    assert {info["raw"][v]["0"][w]["score"] for v in VARIANTS} == {info["raw"]["full"]["0"][w]["score"]}


def test_base_is_dense_gqa_without_mtp_and_batches_mix_the_tasks(bench):
    cfg = base_config(QUICK)
    assert cfg.attention_types == ["gqa"] * QUICK["layers"] and not cfg.use_dsa and cfg.num_nextn_predict_layers == 0
    fn = task_batches(bench, QUICK, 40, seed=3)
    stage = Stage("s", 2, 1e-3, 40, QUICK["batch"])
    ids, labels = fn(0, stage, 0)
    assert ids.shape == labels.shape == (QUICK["batch"], 40)
    text = QUICK["batch"] - QUICK["mqar_rows"] - QUICK["niah_rows"]
    assert bool((labels[:text] != IGNORE_INDEX).all())          # text rows: every next token
    task = labels[text:] != IGNORE_INDEX
    assert bool(task.any(1).all()) and int(task.sum()) < task.numel() // 4  # task rows: answers only
    niah = ids[-QUICK["niah_rows"]:]
    assert bool((niah == bench.tasks.needle).any(1).all())
    again, _ = fn(0, stage, 0)
    other, _ = fn(0, stage, 1)
    assert torch.equal(ids, again) and not torch.equal(ids, other)
