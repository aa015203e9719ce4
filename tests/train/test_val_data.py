"""`glm5lab train --val-data PATH` and `glm5lab eval perplexity RUN PATH`: a held-out set the user names, read in
each format (text, JSONL, a token folder's validation split), scored by the validation instead of the document
split, recorded in summary.json and the report, refused in one line when it cannot be scored, kept on --resume; and
eval perplexity gives the run's own validation figures on the same text."""

import json
from dataclasses import replace

import numpy as np
import pytest

from glm5lab.cli import format_summary, main
from glm5lab.data.heldout import check_window, held_out_set
from glm5lab.data.tokenize import tokenize_corpus
from glm5lab.data.tokenizer import eot_id, load_tokenizer
from glm5lab.evals.perplexity import run_perplexity
from glm5lab.train.loop import TrainArgs, train
from glm5lab.train.plan import check_run
from tests.conftest import write_word_corpus
from tests.train.conftest import tiny_plan


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 9-step tiny run on texts/ validating on --val-data held/ (two other documents), and its root folder."""
    root = tmp_path_factory.mktemp("valdata")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLM5LAB_CACHE", str(root / "cache"))
        from glm5lab import ModelConfig

        write_word_corpus(root / "texts")
        write_word_corpus(root / "held", docs=2, words_per_doc=700, seed=5)
        (root / "config.json").write_text(json.dumps(ModelConfig.from_preset("tiny", vocab_size=320).to_hf()))
        args = _args(root, val_data=str(root / "held"))
        summary = train(args)
        yield root, args, summary


def _args(root, **kw) -> TrainArgs:
    kw = {"out": str(root / "run"), **kw}
    return TrainArgs(config=str(root / "config.json"), data=str(root / "texts"), progress=False, eval_every=3,
                     eval_tokens=96, checkpoint_every=3, stage_plan=tiny_plan(), **kw)


@pytest.fixture
def cache(trained, monkeypatch):
    root = trained[0]
    monkeypatch.setenv("GLM5LAB_CACHE", str(root / "cache"))
    return root


def _tok(root):
    return load_tokenizer(root / "run" / "model" / "tokenizer.json")


def test_the_validation_scores_the_named_set_and_the_summary_says_so(trained):
    root, _, summary = trained
    held = summary["val_set"]
    assert held["path"] == str(root / "held") and held["kind"] == "text" and held["documents"] == 2
    # every window of seq_len 24 + 1 of the set: 24 targets each
    assert summary["val_tokens"] == held["tokens"] // 25 * 24
    assert f"held-out tokens of --val-data {root / 'held'} (perplexity" in format_summary(summary)
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_tokens"] for r in rows if "val_loss" in r] == [96] * 4  # steps 3, 4, 6, 9: the first 4 windows
    run = json.loads((root / "run" / "run.json").read_text())
    assert run["args"]["val_data"] == str(root / "held")


def test_eval_perplexity_gives_the_summarys_figures(trained, cache, capsys):
    root, _, summary = trained
    assert main(["eval", "perplexity", str(root / "run"), str(root / "held"), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    got = json.loads((root / "run" / "evals" / "perplexity.json").read_text())
    assert got["loss"] == pytest.approx(summary["val_loss"], abs=1e-6)
    assert got["bits_per_byte"] == pytest.approx(summary["val_bits_per_byte"], abs=1e-6)
    assert got["tokens"] == summary["val_tokens"] and got["bytes"] == summary["val_bytes"]
    assert f"loss {got['loss']:.4f} nats/token, perplexity {got['perplexity']:.2f}, " in out
    assert f"{got['bits_per_byte']:.4f} bits/byte" in out and f"{got['tokens']:,} tokens scored" in out


def test_the_report_names_the_set(trained):
    from glm5lab.report.render import _val_set

    root, _, summary = trained
    assert _val_set(summary) == f"the held-out set `--val-data {root / 'held'}`, 2 documents"
    assert _val_set({"val_set": {"kind": "split"}}) == _val_set({}) == "the whole held-out split"


def test_text_and_jsonl_are_every_document_joined(trained, cache, tmp_path):
    root = trained[0]
    tok = _tok(root)
    (tmp_path / "one.txt").write_text("the king and the queen\n")
    ids = np.asarray(held_out_set(tmp_path / "one.txt", tok).tokens)
    assert ids.tolist() == tok.encode("the king and the queen\n", add_special_tokens=False).ids
    lines = ["the sea", "", "love and war"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" if t else "\n" for t in lines))
    held = held_out_set(tmp_path / "docs.jsonl", tok)
    want = tok.encode("the sea", add_special_tokens=False).ids + [eot_id(tok)] + \
        tok.encode("love and war", add_special_tokens=False).ids
    assert np.asarray(held.tokens).tolist() == want and held.record["documents"] == 2 and held.record["kind"] == "text"
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["the sea", "love and war"]}), tmp_path / "docs.parquet")
    assert np.asarray(held_out_set(tmp_path / "docs.parquet", tok).tokens).tolist() == want


def test_a_token_folder_gives_its_validation_split(trained, cache, tmp_path):
    root = trained[0]
    tok_file = root / "run" / "model" / "tokenizer.json"
    tokenize_corpus(root / "texts", tmp_path / "tokens", tokenizer=str(tok_file), vocab_size=320, progress=False)
    held = held_out_set(tmp_path / "tokens", _tok(root))
    from glm5lab.data.shards import open_token_folder

    assert np.array_equal(np.asarray(held.tokens), np.asarray(open_token_folder(tmp_path / "tokens").val))
    assert held.record["kind"] == "token folder"
    tokenize_corpus(root / "texts", tmp_path / "other", vocab_size=300, progress=False)  # another (trained) BPE
    with pytest.raises(ValueError, match=r"^--val-data = .*other.* another tokenizer \(sha256 \w{12}\) than the "
                       r"run's \(\w{12}\)"):
        held_out_set(tmp_path / "other", _tok(root))


def test_refusals_are_one_line(trained, cache, tmp_path):
    root = trained[0]
    tok = _tok(root)
    with pytest.raises(ValueError, match=r"^--val-data = '.*nowhere' is not allowed: no such file or folder"):
        check_run(_args(root, out=str(tmp_path / "r"), val_data=str(tmp_path / "nowhere")), 1)
    for same in (root / "texts", next((root / "texts").iterdir())):  # the training text itself, or a file of it
        with pytest.raises(ValueError, match=r"^--val-data = '.*texts.*' is not allowed: a held-out set, not the "
                           r"training text \(--data .*texts\): scored whole it would hold the training documents"):
            check_run(_args(root, out=str(tmp_path / "r"), val_data=str(same)), 1)
    with pytest.raises(ValueError, match=r"^--seq-len = 100000 is not allowed: 1\.\.\d+ \(the model's "
                       r"max_position_embeddings\)$"):
        run_perplexity(root / "run", root / "nowhere-never-read", seq_len=100000)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"^--val-data .*empty.jsonl: .*empty"):
        held_out_set(tmp_path / "empty.jsonl", tok)
    (tmp_path / "other.jsonl").write_text('{"txt": "the king"}\n')  # the hint names the flag in use, not --data
    for name in ("--val-data", "PATH"):
        with pytest.raises(ValueError, match=rf"^{name} .*other.jsonl: .*line 1 has no field 'text' "
                           rf"\(its fields: txt\); {name} reads the field 'text': write the set with its text "
                           "under that name") as e:
            held_out_set(tmp_path / "other.jsonl", tok, name=name)
        assert "--data DIR" not in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "short.txt").write_text("the king")
    held = held_out_set(tmp_path / "short.txt", tok)
    with pytest.raises(ValueError, match=rf"holds {len(held.tokens)} tokens under the run's tokenizer, fewer than one "
                       r"validation window of seq_len 24 \+ 1 = 25 tokens"):
        check_window(held, 24)
    with pytest.raises(ValueError, match=r"^--val-data = .*short.txt.* fewer than one validation window"):
        train(_args(root, out=str(tmp_path / "r"), val_data=str(tmp_path / "short.txt")))
    assert not (tmp_path / "r").exists()


def test_a_resume_keeps_the_set(trained, cache, tmp_path):
    root, args, _ = trained
    (tmp_path / "other.txt").write_text("the fool sings " * 100)
    with pytest.raises(ValueError, match=rf"^--resume: the run in .* validates on --val-data {root / 'held'}, this "
                       rf"resume asks for --val-data {tmp_path / 'other.txt'}: "):
        check_run(replace(args, resume=True, val_data=str(tmp_path / "other.txt")), 1)
    with pytest.raises(ValueError, match=r"this resume asks for no --val-data \(the corpus's document split\)"):
        check_run(replace(args, resume=True, val_data=None), 1)
    with pytest.raises(ValueError, match="already complete"):  # the same set passes on to the next check
        check_run(replace(args, resume=True, val_data=str(root / "held") + "/"), 1)


def test_a_run_resumed_on_its_set_ends_as_the_uninterrupted_one(trained, cache, tmp_path, monkeypatch):
    from tests.train.conftest import train_killed_at

    root, args, summary = trained
    args = replace(args, out=str(tmp_path / "r"))
    train_killed_at(5, args, monkeypatch)
    resumed = train(replace(args, resume=True))
    for key in ("val_loss", "val_bits_per_byte", "val_subset_loss", "val_tokens", "val_set"):
        assert resumed[key] == summary[key], key


def test_the_flag_names_the_default_run_folder():
    from glm5lab.cli import build_parser, default_out

    args = build_parser().parse_args(["train", "--val-data", "sets/wiki.valid.txt"])
    assert args.val_data == "sets/wiki.valid.txt" and default_out(args) == "runs/small-val-wiki.valid"


DRIVER = """
import json, sys
from glm5lab.parallel.dist import end_process
from glm5lab.train.loop import TrainArgs, train
out, plan, root, cp = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
train(TrainArgs(init=root + "/init", data=root + "/texts", out=out, progress=False, eval_every=2, eval_tokens=96,
                checkpoint_every=0, stage_plan=plan, cp=cp, val_data=root + "/held"))
end_process()  # leave as every multi-process run does (glm5lab.parallel.dist.end_process)
"""


def test_under_torchrun_with_cp_the_set_scores_as_in_one_process(corpus, tmp_path):
    """--cp 2 on 2 processes (gloo, CPU) validates on --val-data as one process does: the periodic and the final
    figures within 1e-5 (the CP group sums its positions' CE)."""
    import os
    import subprocess
    import sys

    from tests.conftest import free_port
    from tests.train.conftest import metrics_rows, shared_init

    shared_init(corpus)
    write_word_corpus(corpus / "held", docs=2, words_per_doc=400, seed=7)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    plan = json.dumps(tiny_plan(steps=(2, 1, 1), batch=2))
    runs = {}
    for name, nproc in (("one", 1), ("cp2", 2)):
        launch = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={free_port()}"] if nproc > 1 else [sys.executable])
        r = subprocess.run([*launch, str(tmp_path / "driver.py"), str(tmp_path / name), plan, str(corpus), str(nproc)],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    one, cp2 = runs["one"], runs["cp2"]
    assert one["val_set"] == cp2["val_set"] and one["val_set"]["path"] == str(corpus / "held")
    assert one["val_tokens"] == cp2["val_tokens"] and one["val_bytes"] == cp2["val_bytes"]
    for key in ("val_loss", "val_bits_per_byte", "val_subset_loss"):
        assert abs(one[key] - cp2[key]) <= 1e-5, (key, one[key], cp2[key])
    periodic = [[r["val_loss"] for r in metrics_rows(tmp_path / n) if "val_loss" in r] for n in ("one", "cp2")]
    assert len(periodic[0]) == 3 and max(abs(a - b) for a, b in zip(*periodic, strict=True)) <= 1e-5


def test_a_comparison_of_runs_on_other_sets_says_they_differ():
    from types import SimpleNamespace

    from glm5lab.report.compare import section

    def rec(name, val_data):
        return SimpleNamespace(run_dir=name, run={"args": {"val_data": val_data}, "stages": []}, config={}, metrics=[],
                               summary={"val_loss": 4.0, "val_tokens": 96})

    assert "**The held-out splits differ** (val_data not the same" in section(rec("a", "x"), [rec("b", "y")], None)
    assert "Every run was validated on the same held-out split" in section(rec("a", "x"), [rec("b", "x")], None)
