"""lm-eval adapter (model "glm5lab"): lm-eval's `simple_evaluate` runs three local tasks
(multiple_choice, generate_until, loglikelihood_rolling over the JSONL in `lm_eval_tasks/`) on a
tiny saved model with the network cut off, and every number the adapter returns equals the one
computed here by hand from `model(ids).logits` (log-softmax sums, argmax, greedy `generate`).
Skipped without the `[eval]` extra (lm-eval)."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig, generate
from glm5lab.data.tokenizer import load_tokenizer, train_tokenizer
from tests.conftest import TOL

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from glm5lab.evals.lm_eval_adapter import GLM5LabLM  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
TEXTS = ["The quick brown fox jumps over the lazy dog. Hello world, the cat sat on the mat. "
         "One, two, three, four and five. A red cat and a tall tree on the moon. " * 6]
EOT_ID = 0  # `<|endoftext|>`, the first special token of glm5lab's tokenizer


def close(a: float, b: float) -> bool:
    """fp32 tolerance of tests/conftest.py (a batched, right-padded forward vs a single row)."""
    return math.isclose(a, b, rel_tol=TOL[torch.float32]["rtol"], abs_tol=TOL[torch.float32]["atol"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny model saved with save_pretrained + a 400-token BPE tokenizer.json beside it."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lm_eval") / "ckpt"
    GLM5ForCausalLM(ModelConfig.from_preset("tiny")).save_pretrained(path)
    train_tokenizer(TEXTS, 400, path)
    return path


@pytest.fixture(scope="module")
def ref(folder):
    """(model, tokenizer) loaded independently of the adapter."""
    return GLM5ForCausalLM.from_pretrained(folder, mtp=False).eval(), load_tokenizer(folder)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF hub / datasets offline, their cache in tmp_path, any socket connect an error; the cwd is
    the task folder (the YAMLs name their JSONL relative to it)."""
    import datasets
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
        monkeypatch.setattr(datasets.config, name, True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")

    def no_network(sock, address):
        raise OSError(f"network access to {address} attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.chdir(TASKS)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@torch.no_grad()
def hand_scores(model, inp: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum of log-softmax(logits) of `cont` given the single row `inp` (whose last len(cont)
    positions predict it), and whether each continuation token is the argmax."""
    logp_TV = torch.log_softmax(model(torch.tensor([inp])).logits[0].float(), dim=-1)
    rows_CV = logp_TV[len(inp) - len(cont):]
    target_C = torch.tensor(cont)
    return float(rows_CV.gather(-1, target_C[:, None]).sum()), bool((rows_CV.argmax(-1) == target_C).all())


def hand_loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's contract written out: trailing spaces of the context join the continuation;
    the continuation's tokens are encode(context + continuation) after len(encode(context))."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = encode(tok, context + continuation), encode(tok, context)
    return hand_scores(model, whole[:-1], whole[len(ctx):])


def hand_rolling(model, tok, text: str, window: int) -> float:
    """Each chunk of `window` targets (the last one shorter) scored from the `window` tokens that
    end just before its last target, in the sequence prefixed with `<|endoftext|>`."""
    ids = encode(tok, text)
    seq = [EOT_ID] + ids
    total = 0.0
    for s in range(0, len(ids), window):
        e = min(s + window, len(ids))
        total += hand_scores(model, seq[max(e - window, 0):e], ids[s:e])[0]
    return total


def test_simple_evaluate_offline_matches_hand(folder, ref, offline):
    model, tok = ref
    out = lm_eval.simple_evaluate(
        model="glm5lab", model_args=f"pretrained={folder},batch_size=3",
        tasks=["glm5lab_mc", "glm5lab_gen", "glm5lab_rolling"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False), limit=4, log_samples=True)
    res = out["results"]
    for task, metrics in (("glm5lab_mc", ("acc,none", "acc_norm,none")), ("glm5lab_gen", ("exact_match,none",)),
                          ("glm5lab_rolling", ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"))):
        for metric in metrics:
            assert math.isfinite(res[task][metric]), (task, metric, res[task])
    assert 0 <= res["glm5lab_mc"]["acc,none"] <= 1 and res["glm5lab_rolling"]["byte_perplexity,none"] > 1

    mc = out["samples"]["glm5lab_mc"]
    assert len(mc) == 4
    for sample in mc:
        scores = [hand_loglikelihood(model, tok, *args) for args in sample["arguments"]]
        got = [tuple(resp[0]) for resp in sample["resps"]]
        assert all(close(g[0], h[0]) and g[1] == h[1] for g, h in zip(got, scores, strict=True)), (got, scores)
        # the comparison can fail: the choices' scores differ far beyond the tolerance
        assert max(s[0] for s in scores) - min(s[0] for s in scores) > 1e-3

    for sample in out["samples"]["glm5lab_gen"]:
        (context, kwargs), = sample["arguments"]
        tokens = generate(model, encode(tok, context), 6, stop_tokens=[EOT_ID]).tokens[0]
        text = tok.decode([t for t in tokens if t != EOT_ID])
        for stop in ("\n", "."):
            text = text.split(stop)[0]
        assert sample["resps"][0][0] == text

    for sample in out["samples"]["glm5lab_rolling"]:
        (text,), = sample["arguments"]
        assert close(sample["resps"][0][0], hand_rolling(model, tok, text, window=2048))


def test_loglikelihood_left_truncates_and_rolls_windows(folder, ref):
    """max_length=8: a long request is scored from its last 8 input tokens (HFLM's left
    truncation); rolling windows score every token once, each chunk with a full window."""
    model, tok = ref
    lm = GLM5LabLM(pretrained=str(folder), max_length=8, batch_size=2)
    context, cont = "The quick brown fox jumps over the lazy dog. Hello", " world, the cat"
    reqs = [Instance("loglikelihood", {}, (context, cont), 0), Instance("loglikelihood", {}, ("", "Hello"), 1)]
    (ll, greedy), (ll_empty, _) = lm.loglikelihood(reqs)
    whole, n_ctx = encode(tok, context + cont), len(encode(tok, context))
    assert len(whole) > 9
    want = hand_scores(model, whole[-9:-1], whole[n_ctx:])
    assert close(ll, want[0]) and greedy == want[1]
    assert not close(ll, hand_loglikelihood(model, tok, context, cont)[0])  # untruncated differs
    assert close(ll_empty, hand_scores(model, [EOT_ID] + encode(tok, "Hello")[:-1], encode(tok, "Hello"))[0])

    text = "One, two, three, four and five. A red cat and a tall tree on the moon."
    assert len(encode(tok, text)) > 16
    (rolled,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert close(rolled, hand_rolling(model, tok, text, window=8))


def test_is_greedy_and_stop_strings(folder, ref, monkeypatch):
    """is_greedy is True exactly for the model's own greedy tokens; an `until` string cuts the
    text (and ends the batch early) where the uncut generation would have held it."""
    import glm5lab.evals.lm_eval_adapter as adapter

    model, tok = ref
    ended_early = []

    def spy(*args, **kwargs):  # records, for calls with stop strings, whether every row ended before max_gen_toks
        out = generate(*args, **kwargs)
        if kwargs.get("stop_when") is not None:
            ended_early.append(all(len(row) < args[2] for row in out.tokens))
        return out

    monkeypatch.setattr(adapter, "generate", spy)
    lm = GLM5LabLM(pretrained=str(folder), batch_size=2)
    ctx = encode(tok, "One, two, three,")
    greedy_ids = generate(model, ctx, 5).tokens[0]
    other = [(greedy_ids[0] + 1) % model.config.vocab_size] + greedy_ids[1:]
    (ll, is_greedy), (_, other_greedy) = lm._loglikelihood_tokens([(None, ctx, greedy_ids), (None, ctx, other)])
    assert is_greedy and not other_greedy
    assert close(ll, hand_scores(model, (ctx + greedy_ids)[:-1], greedy_ids)[0])

    prompts = ["One, two, three,", "The quick brown fox"]
    full = lm.generate_until([Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 12}), i)
                              for i, p in enumerate(prompts)])
    assert all(len(text) >= 4 for text in full), full
    stops = [full[0][2:4], full[1][1:3]]
    cut = lm.generate_until([Instance("generate_until", {}, (p, {"until": stops, "max_gen_toks": 12}), i)
                             for i, p in enumerate(prompts)])
    want = [text.split(stops[0])[0].split(stops[1])[0] for text in full]
    assert cut == want and cut != full and ended_early == [True]


def test_refusals(folder):
    with pytest.raises(ValueError, match="batch_size='auto'"):
        GLM5LabLM(pretrained=str(folder), batch_size="auto")
    with pytest.raises(ValueError, match=r"dtype = 'float16' is not allowed: one of fp32, bf16"):
        GLM5LabLM(pretrained=str(folder), dtype="float16")
    with pytest.raises(ValueError, match=r"max_length=4096 is not allowed: an integer in \[1, 2048\]"):
        GLM5LabLM(pretrained=str(folder), max_length=4096)
    lm = GLM5LabLM(pretrained=str(folder), max_length=4)
    with pytest.raises(ValueError, match="continuation of 5 tokens exceeds max_length=4"):
        lm._loglikelihood_tokens([(None, [1], [5, 6, 7, 8, 9])])
    with pytest.raises(ValueError, match=r"generation kwargs \['num_beams'\] are not supported"):
        lm.generate_until([Instance("generate_until", {}, ("Hello", {"until": ["."], "num_beams": 2}), 0)])
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        GLM5LabLM(pretrained=str(folder), tokenizer=str(folder / "missing.json"))
