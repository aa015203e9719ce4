"""A run that continues a checkpoint (--resume, --init) keeps the tokenizer the checkpoint was trained with (issue
36): on a text corpus, as on a token folder, `--tokenizer` another one is refused in one line naming both (the run
and the dry run alike: `check_run` calls `given_tokenizer`), and the checkpoint's own tokenizer is accepted. The dry
run refuses a `--tokenizer` that does not exist, as the run does."""

import dataclasses
import json

import pytest

from glm5lab import ModelConfig
from glm5lab.data.tokenizer import train_tokenizer
from glm5lab.data.pipeline import prepare_data
from glm5lab.train.loop import TrainArgs, train
from glm5lab.train.plan import dry_run
from tests.conftest import write_word_corpus


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A finished 3-step run on a text corpus (its own BPE, vocab 320), and another tokenizer beside it."""
    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    write_word_corpus(tmp_path / "texts", docs=4, words_per_doc=300)
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.from_preset("tiny", vocab_size=320).to_hf()))
    args = TrainArgs(config=str(tmp_path / "config.json"), data=str(tmp_path / "texts"), out=str(tmp_path / "run"),
                     progress=False, seq_len=16, batch_size=2, steps=3, eval_every=0)
    train(args)
    train_tokenizer(["a completely different corpus of other words " * 40], 300, tmp_path / "other")
    return args, tmp_path


def _same_refusal(args, error, message):
    """The dry run and the run raise `error` with the same one line, matching `message`."""
    with pytest.raises(error, match=message) as dry:
        dry_run(args)
    with pytest.raises(error, match=message) as ran:
        train(args)
    assert str(ran.value) == str(dry.value) and "\n" not in str(dry.value)


def test_resume_or_init_with_another_tokenizer_is_refused_by_the_dry_run_and_the_run(run):
    args, root = run
    other = str(root / "other" / "tokenizer.json")
    checkpoints = sorted(p.name for p in (root / "run" / "checkpoints").iterdir())
    resume = dataclasses.replace(args, resume=True, steps=4, tokenizer=other)  # 4 steps: extends the run
    _same_refusal(resume, ValueError, r"^checkpoint .*run/checkpoints/step-000003 was trained with another tokenizer "
                  r"\(sha256 [0-9a-f]{12}\) than --tokenizer .*other/tokenizer.json \([0-9a-f]{12}\): resume with "
                  r"another tokenizer is not allowed; drop --tokenizer \(the checkpoint's tokenizer.json is used\)$")
    assert sorted(p.name for p in (root / "run" / "checkpoints").iterdir()) == checkpoints  # nothing trained
    init = dataclasses.replace(args, config=None, init=str(root / "run"), out=str(root / "run2"), tokenizer=other)
    _same_refusal(init, ValueError, r"^checkpoint .*step-000003 was trained with another tokenizer .* than "
                  r"--tokenizer .*other/tokenizer.json .*: resume with another tokenizer is not allowed")
    assert not (root / "run2").exists()
    with pytest.raises(ValueError, match="resume with another tokenizer is not allowed"):  # the data path itself
        prepare_data(320, args.data, 0, tokenizer=other, checkpoint=root / "run" / "checkpoints" / "step-000003")


def test_the_checkpoints_own_tokenizer_is_accepted(run):
    args, root = run
    own = root / "run" / "checkpoints" / "step-000003"
    for given in (own, own / "tokenizer.json"):
        plan = dry_run(dataclasses.replace(args, resume=True, steps=4, tokenizer=str(given)))
        assert "--resume extends the run" in plan and "by 1 steps" in plan
        plan = dry_run(dataclasses.replace(args, config=None, init=str(root / "run"), out=str(root / "run2"),
                                           tokenizer=str(given)))
        assert plan.startswith("plan of `glm5lab train`")


def test_the_dry_run_refuses_a_missing_tokenizer_as_the_run_does(run):
    args, root = run
    missing = dataclasses.replace(args, out=str(root / "run3"), tokenizer=str(root / "nowhere"))
    _same_refusal(missing, FileNotFoundError, r"^no tokenizer at .*nowhere: expected a tokenizer.json file")
    assert not (root / "run3").exists()
