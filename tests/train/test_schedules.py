"""Learning-rate schedules (`Stage.lr_at`, issue 36 fault 11): linear (unchanged, bit for bit), cosine and
warmup-stable-decay, against values computed by hand; their refusals; recipes that set them; and extended plans
that keep the lr of every trained step."""

import math

import pytest

from glm5lab.train.extend import extend_plan
from glm5lab.train.recipe import builtin_names, load_recipe, resolve
from glm5lab.train.recipe import default_stages
from glm5lab.train.stages import Stage


def _old_lr_at(stage: Stage, i: int) -> float:
    """`Stage.lr_at` before schedules (commit d77f658), for linear and constant stages."""
    if i < stage.warmup_steps:
        return stage.lr * (i + 1) / stage.warmup_steps
    if stage.lr_end is None:
        return stage.lr
    span = max((stage.decay_steps or stage.steps) - 1 - stage.warmup_steps, 1)
    return stage.lr + (stage.lr_end - stage.lr) * min(i - stage.warmup_steps, span) / span


@pytest.mark.parametrize("name", builtin_names())
@pytest.mark.parametrize("quick", [False, True])
def test_the_recipes_lr_curves_are_unchanged(name, quick):
    """Every built-in recipe's stages (and the default plan's) give exactly the lr they gave before schedules."""
    stages = resolve(load_recipe(name), mtp_depth=1, has_indexer=True, quick=quick, world_size=14 if "glm5" in name
                     else 1) + default_stages(quick=quick)
    extended = [Stage.from_dict({**s.to_dict(), "steps": s.steps + 5, "decay_steps": s.steps}) for s in stages]
    for stage in stages + extended:
        assert stage.schedule == "linear"
        for i in range(min(stage.steps, 1200)):
            assert stage.lr_at(i) == _old_lr_at(stage, i), (stage.name, i)


def test_linear_and_constant_by_hand():
    lin = Stage("s", 6, 1e-3, 8, 2, lr_end=1e-4, warmup_steps=2)  # warm-up 2 steps, then 1e-3 -> 1e-4 over 3 steps
    assert [lin.lr_at(i) for i in range(7)] == pytest.approx([5e-4, 1e-3, 1e-3, 7e-4, 4e-4, 1e-4, 1e-4])
    assert [Stage("c", 3, 2e-3, 8, 2, warmup_steps=1).lr_at(i) for i in range(3)] == [2e-3, 2e-3, 2e-3]


def test_cosine_by_hand():
    """Half a cosine period from lr (the first step after the warm-up) to lr_end (the last step): with 4 steps of
    decay the steps between sit at (1 + cos(pi k / 4)) / 2 = 0.8536, 0.5, 0.1464 of the way from lr_end to lr."""
    cos = Stage("s", 6, 1e-3, 8, 2, lr_end=2e-4, warmup_steps=1, schedule="cosine")
    want = [1e-3, 1e-3, 2e-4 + 8e-4 * 0.8535534, 6e-4, 2e-4 + 8e-4 * 0.1464466, 2e-4]
    assert [cos.lr_at(i) for i in range(6)] == pytest.approx(want, rel=1e-6)
    assert cos.lr_at(5) == 2e-4 and cos.lr_at(9) == 2e-4  # lr_end exactly at the end, held after
    assert Stage("z", 3, 1e-3, 8, 2, lr_end=0.0, schedule="cosine").lr_at(2) == 0.0


def test_wsd_by_hand():
    """Warmup-stable-decay: D = max(1, round(decay_ratio x steps)) decay steps at the end, each below lr, the
    last at lr_end; before them lr holds (torchtitan's decay_ratio)."""
    wsd = Stage("s", 10, 1e-3, 8, 2, lr_end=1e-4, warmup_steps=2, schedule="wsd", decay_ratio=0.3)
    assert wsd.wsd_decay_steps == 3
    want = [5e-4, 1e-3] + [1e-3] * 5 + [7e-4, 4e-4, 1e-4]
    assert [wsd.lr_at(i) for i in range(10)] == pytest.approx(want)
    assert wsd.lr_at(6) == 1e-3 and wsd.lr_at(9) == pytest.approx(1e-4)
    tiny = Stage("t", 2, 1e-3, 8, 2, lr_end=0.0, schedule="wsd", decay_ratio=0.1)  # round(0.2) = 0: one step
    assert tiny.wsd_decay_steps == 1 and [tiny.lr_at(i) for i in range(2)] == [1e-3, 0.0]
    whole = Stage("w", 5, 1e-3, 8, 2, lr_end=0.0, warmup_steps=1, schedule="wsd", decay_ratio=0.8)  # no stable part
    assert [whole.lr_at(i) for i in range(5)] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])


@pytest.mark.parametrize("fields, message", [
    (dict(schedule="step"), r"stage 's': `schedule` = 'step' is not allowed: one of \('linear', 'cosine', 'wsd'\)"),
    (dict(schedule="cosine"), r"stage 's': `lr_end` = None is not allowed: a number >= 0 with schedule = 'cosine'"),
    (dict(schedule="wsd", lr_end=0.0), r"`decay_ratio` = None is not allowed: a number in \(0, 1\] with schedule"),
    (dict(lr_end=0.0, decay_ratio=0.5), r"`decay_ratio` = 0.5 is not allowed: only with schedule = 'wsd'"),
    (dict(schedule="wsd", lr_end=0.0, decay_ratio=0.0), r"`decay_ratio` = 0.0 is not allowed: a number in \(0, 1\]"),
    (dict(schedule="wsd", lr_end=0.0, decay_ratio=float("nan")), r"`decay_ratio` = nan is not allowed"),
    (dict(schedule="wsd", lr_end=0.0, decay_ratio=0.9, warmup_steps=5), r"stage 's': `decay_ratio` = 0.9 is not "
     r"allowed: at most 0.5 here: its decay of max\(1, round\(0.9 x 10\)\) = 9 steps must fit after the warm-up of 5 "
     r"steps \(of 10\)"),
    # the attack pass on issue 36 (findings 3, 4): a Stage refuses what a recipe refuses (one rule: `check_values`)
    (dict(lr=float("inf")), r"^stage 's': `lr` = inf is not allowed: a finite number > 0$"),
    (dict(lr_end=float("nan")), r"^stage 's': `lr_end` = nan is not allowed: a finite number >= 0$"),
    (dict(lm_weight=-1.0), r"^stage 's': `lm_weight` = -1.0 is not allowed: a finite number >= 0$"),
    (dict(mtp_weights=(0.3, float("nan"))), r"`mtp_weights` = \[0.3, nan\] is not allowed: finite numbers >= 0"),
    (dict(indexer_weight=float("inf")), r"`indexer_weight` = inf is not allowed"),
    (dict(trainable="indexer", lm_weight=0.0, mtp_weights=(0.0,)), r"^stage 's': `indexer_weight` = 0.0 is not "
     r"allowed: a number > 0 with trainable = 'indexer'"),
    (dict(lm_weight=0.0, mtp_weights=()), r"^stage 's': `lm_weight` = 0.0 is not allowed: 0 with mtp_weights \[\] and "
     r"indexer_weight 0.0: the stage's loss is 0 and trains nothing"),
    (dict(lr_end=0.0, warmup_steps=4, decay_steps=4), r"^stage 's': `decay_steps` = 4 is not allowed: more than "
     r"warmup_steps \(4\)"),
    (dict(lr_end=0.0, warmup_steps=4, decay_steps=2, schedule="cosine"), r"`decay_steps` = 2 is not allowed"),
    # the attack pass on issue 40: None was accepted here and failed in the forward (or the loss) at the stage
    (dict(indexer_target=None), r"^stage 's': `indexer_target` = None is not allowed: one of \('own', 'served'\)$"),
    (dict(indexer_target="Served"), r"^stage 's': `indexer_target` = 'Served' is not allowed"),
    (dict(indexer_weight=None), r"^stage 's': `indexer_weight` = None is not allowed: a finite number >= 0$"),
])
def test_schedules_no_run_can_mean_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Stage(**{"name": "s", "steps": 10, "lr": 1e-3, "seq_len": 8, "batch_size": 2, **fields})


def test_a_recipe_sets_a_schedule_and_quick_keeps_its_shape(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("""
[defaults]
seq_len = 16
batch_size = 2
schedule = "cosine"
lr_end = 1e-5
[[stages]]
name = "a"
steps = 100
lr = 1e-3
[[stages]]
name = "b"
steps = 50
lr = 1e-3
schedule = "wsd"
decay_ratio = 0.2
""")
    a, b = resolve(load_recipe(str(path)), mtp_depth=0, has_indexer=False)
    assert (a.schedule, a.decay_ratio, b.schedule, b.decay_ratio, b.wsd_decay_steps) == ("cosine", None, "wsd", 0.2, 10)
    assert b.lr_at(39) == 1e-3 and b.lr_at(40) < 1e-3 and b.lr_at(49) == pytest.approx(1e-5)
    qa, qb = resolve(load_recipe(str(path)), mtp_depth=0, has_indexer=False, quick=True)  # 4 and 2 steps
    assert (qa.steps, qb.steps, qb.wsd_decay_steps) == (4, 2, 1)
    assert qa.lr_at(1) == pytest.approx(1e-5 + (1e-3 - 1e-5) * (1 + math.cos(math.pi / 3)) / 2)
    assert [qb.lr_at(i) for i in range(2)] == pytest.approx([1e-3, 1e-5])


@pytest.mark.parametrize("schedule", [dict(schedule="cosine"), dict(schedule="wsd", decay_ratio=0.25)])
def test_an_extended_plan_keeps_the_lr_of_trained_steps(schedule):
    """--resume with more steps (`extend_plan`): the last stage's decay_steps stays at its former length, so every
    trained step keeps its lr and the appended steps hold lr_end, for cosine and WSD as for linear."""
    saved = [Stage("a", 4, 1e-3, 8, 2, lr_end=1e-4, warmup_steps=1, **schedule),
             Stage("b", 8, 1e-3, 8, 2, lr_end=1e-4, warmup_steps=1, **schedule)]
    plan, more = extend_plan(saved, saved, total=16)
    assert more == 4 and plan[0] == saved[0] and (plan[1].steps, plan[1].decay_steps) == (12, 8)
    assert [plan[1].lr_at(i) for i in range(8)] == [saved[1].lr_at(i) for i in range(8)]
    assert [plan[1].lr_at(i) for i in range(8, 12)] == pytest.approx([1e-4] * 4)
    assert plan[1].lr_at(7) == pytest.approx(1e-4)  # the decay ends where it was planned (not stretched to 12)


@pytest.mark.parametrize("schedule", [dict(schedule="linear"), dict(schedule="cosine"),
                                      dict(schedule="wsd", decay_ratio=0.01)])
def test_lr_end_is_reached_at_step_h_for_every_schedule(schedule):
    """docs/recipes.md's rule, for every stage length, warm-up and decay_steps H (above the warm-up): the warm-up
    ends at lr, lr_end is reached at step H (1-based) and held after. Linear and cosine missed it when H = W + 1
    (the one step after the warm-up trained at lr) while WSD reached it: a 1-step stage trained at lr or lr_end by
    its schedule (the attack pass on issue 36, finding 4)."""
    for steps in range(1, 8):
        for w in range(steps):
            for h in (None, *range(w + 1, steps + 3)):
                stage = Stage("s", steps, 1e-3, 8, 2, lr_end=1e-4, warmup_steps=w, decay_steps=h, **schedule)
                end = (h or steps) - 1
                lrs = [stage.lr_at(i) for i in range(steps + 2)]
                assert lrs[:w] == pytest.approx([1e-3 * (i + 1) / w for i in range(w)])
                assert lrs[end:] == pytest.approx([1e-4] * (steps + 2 - end)), (steps, w, h)
                assert all(1e-4 - 1e-12 < lr <= 1e-3 for lr in lrs[w:end])
                if schedule["schedule"] != "wsd" and end > w:
                    assert lrs[w] == 1e-3  # linear and cosine start at lr: the same curves as before
    one = Stage("one", 1, 1e-3, 8, 2, lr_end=1e-4, **schedule)
    assert one.lr_at(0) == pytest.approx(1e-4)  # a 1-step stage trains at lr_end, whatever its schedule


def test_quick_keeps_the_decay_after_the_warm_up(tmp_path):
    """--quick divides warmup_steps and decay_steps by 25: the decay still ends after the warm-up (it could end on
    it: a decay_steps <= warmup_steps, refused)."""
    path = tmp_path / "r.toml"
    path.write_text("[[stages]]\nname = 'a'\nsteps = 250\nlr = 1e-3\nlr_end = 1e-4\nwarmup_steps = 50\n"
                    "decay_steps = 60\nseq_len = 16\nbatch_size = 2\n")
    (a,) = resolve(load_recipe(str(path)), mtp_depth=0, has_indexer=False, quick=True)
    assert (a.steps, a.warmup_steps, a.decay_steps) == (10, 2, 3)
    assert [a.lr_at(i) for i in range(4)] == pytest.approx([5e-4, 1e-3, 1e-4, 1e-4])
