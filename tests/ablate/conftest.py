"""A small word corpus for the study tests (no download): 6 documents of random words, with its
own tokenizer cache (GLM5LAB_CACHE). Pass `data=str(study_corpus)` to StudyArgs / Workbench.load."""

import os

import pytest

from tests.conftest import write_word_corpus

WORDS = ("the king and queen of denmark speak of love war and the sea while the fool sings "
         "my lord a horse is come to court with letters from france good night sweet prince").split()


@pytest.fixture(scope="session")
def study_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("study_corpus")
    old = os.environ.get("GLM5LAB_CACHE")
    os.environ["GLM5LAB_CACHE"] = str(root / "cache")
    folder = write_word_corpus(root / "texts", words_per_doc=6000, words=WORDS)
    yield folder
    if old is None:
        os.environ.pop("GLM5LAB_CACHE", None)
    else:
        os.environ["GLM5LAB_CACHE"] = old


@pytest.fixture(scope="session")
def bench(study_corpus):
    from glm5lab.ablate.workbench import Workbench

    return Workbench.load(data=str(study_corpus))


def run_quick(tmp_path_factory, study: str, corpus) -> tuple:
    """(results folder, table text) of `glm5lab ablate STUDY --quick` on the word corpus."""
    from glm5lab.ablate.runner import StudyArgs, run_study

    out = tmp_path_factory.mktemp(study)
    _, text = run_study(StudyArgs(study, quick=True, out=str(out), progress=False, data=str(corpus)))
    return out, text


@pytest.fixture(scope="session")
def two_seed_run(tmp_path_factory, study_corpus):
    """study -> the folder of its `glm5lab ablate STUDY --quick --seeds 2` on the word corpus, run on first ask and
    shared by the session (test_summary, test_seeds). Read it; copy it before changing anything."""
    from glm5lab.ablate.runner import StudyArgs, run_study

    made = {}

    def get(study: str):
        if study not in made:
            out = tmp_path_factory.mktemp(f"{study}-2-seeds") / study
            run_study(StudyArgs(study, quick=True, seeds=2, out=str(out), progress=False, data=str(study_corpus)))
            made[study] = out
        return made[study]

    return get
