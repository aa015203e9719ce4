"""A small word corpus for the study tests (no download): 6 documents of random words, with its
own tokenizer cache (GLM5LAB_CACHE). Pass `data=str(study_corpus)` to StudyArgs / Workbench.load."""

import os

import pytest
import torch

WORDS = ("the king and queen of denmark speak of love war and the sea while the fool sings "
         "my lord a horse is come to court with letters from france good night sweet prince").split()


@pytest.fixture(scope="session")
def study_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("study_corpus")
    old = os.environ.get("GLM5LAB_CACHE")
    os.environ["GLM5LAB_CACHE"] = str(root / "cache")
    g = torch.Generator().manual_seed(0)
    folder = root / "texts"
    folder.mkdir()
    for d in range(6):
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (6000,), generator=g)]
        (folder / f"doc{d}.txt").write_text(" ".join(words))
    yield folder
    if old is None:
        os.environ.pop("GLM5LAB_CACHE", None)
    else:
        os.environ["GLM5LAB_CACHE"] = old


@pytest.fixture(scope="session")
def bench(study_corpus):
    from glm5lab.ablate.workbench import Workbench

    return Workbench.load(data=str(study_corpus))
