"""Seeded synthetic long-context tasks on token ids (evaluation and training data): RULER
needle-in-a-haystack variants (`niah`), Zoology's MQAR (`mqar`), and sliding-window
perplexity on held-out ids (`perplexity`). Reserved ids come from a `TaskVocab`."""

from glm5lab.evals.mqar import (
    MQARExample, generation_prompts, make_mqar, make_mqar_batch, mqar_accuracy, score_generated,
)
from glm5lab.evals.niah import (
    VARIANTS, Needle, NIAHExample, make_niah, make_niah_batch, prompts_tensor, score_niah, training_pair,
)
from glm5lab.evals.perplexity import PerplexityResult, perplexity
from glm5lab.evals.search_indexcache import IndexCacheRow, search_indexcache, uniform_pattern
from glm5lab.evals.search_swa import SWASearchResult, interleave_pattern, search_swa
from glm5lab.evals.tasks import IGNORE_INDEX, Scores, TaskVocab, derive_seed

__all__ = [
    "IGNORE_INDEX", "IndexCacheRow", "SWASearchResult", "interleave_pattern", "search_indexcache",
    "search_swa", "uniform_pattern", "VARIANTS", "MQARExample", "NIAHExample", "Needle",
    "PerplexityResult", "Scores", "TaskVocab", "derive_seed", "generation_prompts", "make_mqar",
    "make_mqar_batch", "make_niah", "make_niah_batch", "mqar_accuracy", "perplexity", "prompts_tensor",
    "score_generated", "score_niah", "training_pair",
]
