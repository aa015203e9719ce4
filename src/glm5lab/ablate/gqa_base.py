"""The full-attention GQA base the `swa` and `efficient` studies share: its sizes (`SIZES`), model
(`base_config`), training batches and stage, and how it is scored (`retrieval`) and searched
(`search_pattern`), so both studies start from the same recipe.

GQA rather than MLA: the same base then serves SimpleGDN (fed from GQA q/k/v/o) in `study_efficient`.
"""

from __future__ import annotations

import torch

from glm5lab import GLM5ForCausalLM
from glm5lab.ablate.fit import decay_stage, fit
from glm5lab.ablate.measure import mqar_accuracy, niah_accuracy
from glm5lab.ablate.models import seeded_model, study_config, variant_config
from glm5lab.ablate.workbench import BatchFn, Workbench
from glm5lab.evals.niah import make_niah_batch, training_pair
from glm5lab.evals.search_swa import mqar_scorer, niah_scorer, search_swa
from glm5lab.evals.tasks import derive_seed
from glm5lab.train.stages import Stage

NIAH_COMPLETION = 3  # single NIAH, value_len 2: completion = value + [end]; a row is context + 2 ids
SIZES = {
    "quick": dict(layers=4, hidden=64, seq_len=32, window=16, batch=8, mqar_rows=3, niah_rows=3, pairs=2, steps=8,
                  lr=3e-3, eval_rows=8, search_rows=8, lengths=(16, 32, 64), seeds=1),
    "cpu": dict(layers=6, hidden=128, seq_len=64, window=16, batch=16, mqar_rows=5, niah_rows=5, pairs=3, steps=1200,
                lr=5e-3, eval_rows=64, search_rows=32, lengths=(16, 32, 64, 128), seeds=3),
    "gpu": dict(layers=12, hidden=768, seq_len=2048, window=512, batch=16, mqar_rows=4, niah_rows=4, pairs=16,
                steps=3000, lr=2e-3, eval_rows=64, search_rows=16, lengths=(512, 1024, 2048, 4096), seeds=3),
    "gpu-quick": dict(layers=4, hidden=768, seq_len=2048, window=512, batch=3, mqar_rows=1, niah_rows=1, pairs=16,
                      steps=2, lr=2e-3, eval_rows=1, search_rows=1, lengths=(512, 2048), seeds=1),
}
"""layers, hidden: the base model. seq_len: T, base training length (tokens). window: w, keys
per query on an SWA layer. batch: rows per step, of which mqar_rows MQAR (`pairs` key-value
pairs) and niah_rows NIAH, the rest text. steps, lr: base training (linear warm-up over 5%,
decay to lr / 10). eval_rows: rows per task and length; search_rows: rows per task of the
search score. lengths: evaluation lengths (tokens per row). seeds: unless --seeds.
gpu: a ~76M-parameter 12-layer base at 2K tokens, window 512, retrieval up to 4K; 3000 steps of
16 x 2048 tokens (about 98M tokens: an estimated 1-2 GPU-hours per seed on one H100-class GPU,
not measured). gpu-quick: the same widths and lengths with 4 layers, 2 steps and one row per score (a CPU
smoke run)."""


def base_config(sz: dict):
    """The full-attention GQA base: study_config(layers, hidden) as "gqa-8" (8 query heads, 2 KV heads, DSA
    off), no MTP layer, positions up to 4 x seq_len (what `study_efficient` scores) and at least 4096."""
    cfg = study_config(hidden_size=sz["hidden"], num_hidden_layers=sz["layers"], num_nextn_predict_layers=0,
                       max_position_embeddings=max(4096, 4 * sz["seq_len"], max(sz["lengths"])))
    return variant_config(cfg, "gqa-8")


def task_batches(bench: Workbench, sz: dict, seq_len: int, *, seed: int) -> BatchFn:
    """Batches of `sz["batch"]` rows of `seq_len` tokens: text, `sz["mqar_rows"]` MQAR and `sz["niah_rows"]`
    single-needle NIAH rows (noise haystack), fresh every step (seeded)."""
    mixed = bench.mixed(seq_len, sz["batch"] - sz["niah_rows"], task_rows=sz["mqar_rows"], num_kv_pairs=sz["pairs"],
                        seed=seed)

    def batch(stage_index: int, stage: Stage, i: int):
        ids_BT, labels_BT = mixed(stage_index, stage, i)
        if not sz["niah_rows"]:
            return ids_BT, labels_BT
        examples = make_niah_batch(bench.tasks, sz["niah_rows"], seq_len - NIAH_COMPLETION + 1, "single",
                                   seed=derive_seed(seed, stage_index * 1_000_003 + i, "ablate-niah"))
        pairs = [training_pair(e) for e in examples]
        return (torch.cat([ids_BT, torch.stack([p[0] for p in pairs])]),
                torch.cat([labels_BT, torch.stack([p[1] for p in pairs])]))

    return batch


def base_stage(sz: dict) -> Stage:
    """The base training Stage at size `sz` (warm-up 5%, linear decay to lr / 10)."""
    return decay_stage("base", sz["steps"], sz["lr"], sz["seq_len"], sz["batch"], max(1, sz["steps"] // 20))


def train_base(bench: Workbench, sz: dict, *, seed: int, device="cpu") -> tuple[GLM5ForCausalLM, list[dict]]:
    """A freshly initialised (torch seed `seed`, on the CPU, then moved to `device`) base trained
    by `fit` (muon-split) on `task_batches(.., sz["seq_len"], seed=seed)`; returns (model in eval
    mode, per-step records)."""
    model = seeded_model(base_config(sz), seed, device)
    records = fit(model, [base_stage(sz)], task_batches(bench, sz, sz["seq_len"], seed=seed), seed=seed)
    return model, records


def retrieval(model, bench: Workbench, sz: dict, length: int, *, seed: int) -> dict[str, float]:
    """{"mqar": per-query accuracy, "niah": exact match, "score": 100 x their mean} on
    `sz["eval_rows"]` fresh rows each of `length` tokens (the same rows for every model given seed)."""
    mqar = mqar_accuracy(model, bench, sz["eval_rows"], length, sz["pairs"],
                         seed=derive_seed(seed, length, "swa-eval-mqar"))
    niah = niah_accuracy(model, bench, sz["eval_rows"], length - NIAH_COMPLETION + 1,
                         seed=derive_seed(seed, length, "swa-eval-niah"))
    return {"mqar": mqar, "niah": niah, "score": 50.0 * (mqar + niah)}


def search_pattern(model, bench: Workbench, sz: dict, *, seed: int):
    """`search_swa` (beam 8, 2 layers per round, half the layers SWA, window sz["window"]) scored by the
    mean of MQAR and NIAH token accuracy at length sz["seq_len"] on search-only rows."""
    s = derive_seed(seed, 0, "swa-search")
    mqar = mqar_scorer(bench.tasks, sz["search_rows"], sz["seq_len"], sz["pairs"], seed=s)
    niah = niah_scorer(bench.tasks, sz["search_rows"], sz["seq_len"] - NIAH_COMPLETION + 1, seed=s)
    return search_swa(model, lambda m: 0.5 * (mqar(m) + niah(m)), window=sz["window"], target_fraction=0.5,
                      beam=8, per_round=2)
