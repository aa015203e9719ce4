"""Merge two seed batches of a study's JSON numbers (`runner.merge_seeds`): one recursive rule for every study.

A study's raw numbers (and the per-seed parts of its settings) are nested dicts whose keys are, at some depth,
seed strings ("0", "1", ...), or lists with one entry per seed in seed order (study_dsa's
mqar_accuracy_pct[arm][length]). Merging an old batch (seeds S_old) with a new one (seeds S_new, disjoint):

  dict + dict           merged key by key (old keys first, then the new ones, as one run over S_old + S_new
                        would have built them)
  key on one side only  taken as it is (a seed's entry)
  equal values          kept (scalars; lists that are not per-seed, such as settings' lengths)
  list + list           concatenated, old first, only when per_seed_lists and len(old) == |S_old| and
                        len(new) == |S_new| (a per-seed list)
  anything else         a conflict: ValueError naming the path (e.g. raw.MLA.0.val_loss)

The one ambiguity: a raw list that is not per-seed but happens to be as long as both batches, and differs, would
be concatenated; no study writes one (tests/ablate/test_seeds.py extends mla, dsa, mtp, optimizer and swa and
compares with one run; efficient and baseline were compared by hand the same way, and indexcache at --quick
(1 then 2 seeds vs 2 at once: every number but the wall times equal)).
"""

from __future__ import annotations

import json


def as_json(value):
    """`value` as results.json holds it: tuples become lists, int keys strings (a JSON round trip)."""
    return json.loads(json.dumps(value))


def merge_json(old, new, n_old: int, n_new: int, *, path: str, per_seed_lists: bool = True, keep_old=()):
    """`old` and `new` (JSON values of S_old and S_new seeds) merged by the rule of the module docstring.
    keep_old: keys at this level whose old value is kept even when the new one differs (settings' device and
    threads, which `runner.merge_seeds` records per run instead). Raises ValueError naming the first conflict's
    path and both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = dict(old)
        for key, value in new.items():
            if key in old and key not in keep_old:
                out[key] = merge_json(old[key], value, n_old, n_new, path=f"{path}.{key}",
                                      per_seed_lists=per_seed_lists)
            elif key not in old:
                out[key] = value
        return out
    if (per_seed_lists and isinstance(old, list) and isinstance(new, list) and len(old) == n_old
            and len(new) == n_new):
        return old + new
    if type(old) is type(new) and old == new:
        return old
    raise ValueError(f"{path}: the old seeds' {_short(old)} and the new seeds' {_short(new)} cannot be merged "
                     "(neither per-seed entries nor equal)")


def _short(value, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."
