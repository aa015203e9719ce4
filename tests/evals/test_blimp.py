"""`glm5lab eval blimp` and its library: the batched scorer against hand-computed log-probabilities and
transformers' own (a tiny random GPT-2 built here), the interval, the grouping, the packaged data, the CLI on a
tiny glm5lab checkpoint and an HF folder, and bad input refused in one line. A 9-pair fixture written per test
session stands for the 67,000-pair file (the packaged copy is only opened, for its counts)."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch

from glm5lab.cli import main
from glm5lab.evals import blimp
from glm5lab.evals.blimp import load_pairs, load_published, mean_with_interval, summarize
from glm5lab.evals.sentence_logprob import sequence_logprobs

# paradigm -> (data's linguistics_term, published group); the published file regroups s-selection as the paper does
PARADIGMS = {"anaphor_gender_agreement": ("anaphor_agreement", "anaphor_agreement"),
             "animate_subject_passive": ("s-selection", "argument_structure"),
             "causative": ("argument_structure", "argument_structure")}
SENTENCES = [("the cat sees the dog .", "the cat see the dog ."), ("a dog runs .", "a dog run ."),
             ("the dogs run .", "the dogs runs .")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """3 paradigms x 3 pairs and their published figures, in the packaged copy's layout."""
    folder = tmp_path_factory.mktemp("blimp")
    lines = [json.dumps({"UID": uid, "field": "x", "linguistics_term": term, "pairID": str(i), "sentence_good": g,
                         "sentence_bad": b}) for uid, (term, _) in PARADIGMS.items() for i, (g, b) in enumerate(SENTENCES)]
    with gzip.open(folder / blimp.PAIRS_FILE, "wt") as f:
        f.write("\n".join(lines) + "\n")
    pub = [{"UID": uid, "linguistics_term": group, "ngram": 0.5 + 0.1 * i, "lstm": 0.6, "txl": 0.7, "gpt2": 0.9}
           for i, (uid, (_, group)) in enumerate(PARADIGMS.items())]
    pub.append({"UID": "overall", "linguistics_term": "overall", "ngram": 0.6, "lstm": 0.6, "txl": 0.7, "gpt2": 0.9})
    (folder / blimp.PUBLISHED_FILE).write_text("".join(json.dumps(r) + "\n" for r in pub))
    return folder


def _table_logits(table):
    """A 'model' whose logits at position t are table[ids[t]] (a bigram table [V, V])."""
    return lambda ids_BT, mask_BT: table[ids_BT]


def _hand_logprob(table, seq) -> float:
    """sum_t log softmax(table[seq[t-1]])[seq[t]], in plain Python floats."""
    total = 0.0
    for prev, tok in zip(seq, seq[1:]):
        row = [float(v) for v in table[prev]]
        total += row[tok] - math.log(sum(math.exp(v) for v in row))
    return total


def test_scorer_equals_hand_computed_sums_at_any_batch_size():
    torch.manual_seed(0)
    table = torch.randn(6, 6)
    seqs = [[0, 3, 1], [0, 2], [0, 5, 4, 4, 1], [0, 1, 1, 2]]
    hand = [_hand_logprob(table, s) for s in seqs]
    assert hand[1] == pytest.approx(float(torch.log_softmax(table[0], -1)[2]), abs=1e-6)  # the first token counts
    for batch_size in (1, 2, 3, 8):  # padding and the length sort must not change any sum, nor the order
        assert sequence_logprobs(_table_logits(table), seqs, batch_size=batch_size) == pytest.approx(hand, abs=1e-5)
    garbage = sequence_logprobs(_table_logits(table), [s[:-1] + [(s[-1] + 1) % 6] for s in seqs if len(s) > 2])
    assert garbage != pytest.approx([h for h, s in zip(hand, seqs) if len(s) > 2], abs=1e-3)


def test_scorer_refuses_a_sequence_without_a_scored_token():
    with pytest.raises(ValueError, match="sequence 1 has 1 tokens: at least 2"):
        sequence_logprobs(_table_logits(torch.zeros(3, 3)), [[0, 1], [0]])


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0)).eval()


def test_scorer_equals_transformers_own_loss_on_a_tiny_gpt2():
    model = _tiny_gpt2()
    seqs = [[0, 5, 9, 3], [0, 7], [0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 39, 38]]
    own = []
    with torch.no_grad():
        for s in seqs:  # one sequence at a time, no padding: the mean NLL over len - 1 targets
            ids = torch.tensor([s])
            own.append(-float(model(input_ids=ids, labels=ids).loss) * (len(s) - 1))
    ours = sequence_logprobs(lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits, seqs, batch_size=3)
    assert ours == pytest.approx(own, abs=1e-4)


def test_interval_is_the_normal_approximation_of_the_mean_over_paradigms():
    mean, lo, hi = mean_with_interval([0.5, 1.0], [4, 2])
    half = blimp.Z95 * math.sqrt(0.5 * 0.5 / 4 + 0.0) / 2
    assert (mean, lo, hi) == pytest.approx((0.75, 0.75 - half, 0.75 + half))
    assert half == pytest.approx(0.245, abs=1e-3)


def test_grouping_ties_and_published_figures(data_dir):
    pairs = load_pairs(data_dir)
    assert [p.group for p in pairs[3:6]] == ["argument_structure"] * 3  # s-selection filed as the paper does
    # anaphor: 3/3 right; animate: 1 right, 1 tie (wrong), 1 wrong; causative: 2/3
    good = [0, 0, 0, -1, -2, -3, 0, 0, -5]
    bad = [-1, -1, -1, -2, -2, -1, -1, -1, -1]
    r = summarize(pairs, good, bad, load_published(data_dir))
    assert r["ties"] == 1 and r["pairs"] == 9
    assert r["paradigms"]["animate_subject_passive"]["accuracy"] == pytest.approx(1 / 3)
    assert r["groups"]["argument_structure"]["accuracy"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert r["groups"]["argument_structure"]["published"]["ngram"] == pytest.approx((0.6 + 0.7) / 2)
    assert r["groups"]["anaphor_agreement"]["ci95"] == pytest.approx([1.0, 1.0])
    assert r["overall"]["accuracy"] == pytest.approx((1 + 1 / 3 + 2 / 3) / 3)
    assert r["overall"]["published"]["ngram"] == pytest.approx(0.6)
    table = blimp.render_table(r)
    assert "| argument_structure | 2 | 50.0 (" in table and "| 65.0 | 60.0 | 70.0 | 90.0 |" in table


def test_limit_keeps_every_paradigm(data_dir):
    pairs = load_pairs(data_dir, limit=2)
    assert [p.uid for p in pairs] == [u for u in PARADIGMS for _ in range(2)]
    with pytest.raises(ValueError, match="--limit 0 is not allowed"):
        load_pairs(data_dir, limit=0)
    with pytest.raises(ValueError, match="--limit 4 is not allowed: at most 3"):
        load_pairs(data_dir, limit=4)


def test_a_malformed_published_figures_file_is_refused_naming_its_line(tmp_path):
    (tmp_path / "models_summary.jsonl").write_text('\n{"UID": "x"}\n')
    with pytest.raises(ValueError, match=r"models_summary.jsonl line 2: not a BLiMP models_summary row \(KeyError: "):
        load_published(tmp_path)
    (tmp_path / "models_summary.jsonl").write_text("garbage{\n")
    with pytest.raises(ValueError, match=r"models_summary.jsonl line 1: not a BLiMP models_summary row \(JSONDecodeError"):
        load_published(tmp_path)


@pytest.mark.parametrize("content, message", [
    (gzip.compress(b""), "blimp.jsonl.gz holds no BLiMP pairs: give the folder of a BLiMP copy$"),
    (b"not gzip", r"blimp.jsonl.gz: not a gzip-compressed UTF-8 JSONL file \(Not a gzipped file"),
    (gzip.compress(b"\xff\xfe\n"), r"blimp.jsonl.gz: not a gzip-compressed UTF-8 JSONL file \('utf-8' codec"),
])
def test_an_empty_or_foreign_pairs_file_is_refused_in_one_line(data_dir, tmp_path, content, message):
    (tmp_path / "models_summary.jsonl").write_bytes((data_dir / "models_summary.jsonl").read_bytes())
    (tmp_path / "blimp.jsonl.gz").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_pairs(tmp_path, limit=1)


def test_the_packaged_copy_reproduces_the_papers_overall_figures():
    published = load_published()
    assert len(published) == 67 and len({v["group"] for v in published.values()}) == 12
    means = {k: sum(v[k] for v in published.values()) / 67 for k in blimp.PUBLISHED}
    assert {k: round(100 * m, 1) for k, m in means.items()} == {"ngram": 61.2, "lstm": 69.8, "txl": 69.6, "gpt2": 83.0}
    assert (blimp.DATA_DIR / "README.md").read_text().count("CC BY 4.0") == 1


def cli(capsys, *args):
    status = main(["eval", "blimp", *args, "--threads", "1", "--no-progress"])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(scope="module")
def glm5lab_folder(tmp_path_factory):
    """A tiny glm5lab checkpoint with a tokenizer trained on the fixture's words."""
    from glm5lab import GLM5ForCausalLM, ModelConfig
    from glm5lab.data.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    GLM5ForCausalLM(ModelConfig.from_preset("tiny")).save_pretrained(folder)
    train_tokenizer([" ".join(g + " " + b for g, b in SENTENCES) * 4], 300, folder)
    return folder


def test_cli_on_a_glm5lab_checkpoint_scores_after_endoftext(capsys, glm5lab_folder, data_dir):
    from glm5lab.data.tokenizer import load_tokenizer
    from glm5lab.model.model import GLM5ForCausalLM

    status, out, err = cli(capsys, str(glm5lab_folder), "--data", str(data_dir), "--batch-size", "4")
    assert status == 0, err
    result = json.loads((glm5lab_folder / "blimp.json").read_text())
    assert result["prefix_token"] == "<|endoftext|>" and result["subset"] is None
    tok, model = load_tokenizer(glm5lab_folder), GLM5ForCausalLM.from_pretrained(glm5lab_folder).eval()
    right = []
    with torch.no_grad():  # each sentence alone, unbatched: log p of every token after <|endoftext|> (id 0)
        for good, bad in SENTENCES:
            lp = []
            for text in (good, bad):
                ids = torch.tensor([[0, *tok.encode(text).ids]])
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
                lp.append(float(logp.gather(-1, ids[0, 1:, None]).sum()))
            right.append(lp[0] > lp[1])
    assert result["overall"]["accuracy"] == pytest.approx(sum(right) / 3)
    assert "| **overall** (mean of paradigms) | 3 |" in out and "60.0 | 60.0 | 70.0 | 90.0 |" in out


def test_cli_limit_writes_a_marked_subset_beside(capsys, glm5lab_folder, data_dir, tmp_path):
    status, out, err = cli(capsys, str(glm5lab_folder), "--data", str(data_dir), "--limit", "1")
    assert status == 0, err
    assert out.startswith("BLiMP (SUBSET: first 1 pairs of each paradigm;")
    assert json.loads((glm5lab_folder / "blimp-limit1.json").read_text())["pairs"] == 3


def test_cli_hf_folder_matches_transformers(capsys, data_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for pair in SENTENCES for s in pair for w in s.split()})
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", unk_token="[UNK]")
    model = _tiny_gpt2()
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    status, out, err = cli(capsys, "--hf", str(tmp_path / "hf"), "--data", str(data_dir), "--out", str(tmp_path / "r.json"))
    assert status == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["prefix_token"] == "<|endoftext|>" and result["kind"] == "hf"
    right = []
    with torch.no_grad():
        for good, bad in SENTENCES:
            lp = []
            for text in (good, bad):
                ids = torch.tensor([[0, *[vocab[w] for w in text.split()]]])
                lp.append(-float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1))
            right.append(lp[0] > lp[1])
    assert result["overall"]["accuracy"] == pytest.approx(sum(right) / 3)


@pytest.mark.parametrize("args, line", [
    (["{ckpt}", "--data", "/nonexistent/blimp"], "glm5lab eval: error: --data /nonexistent/blimp is not allowed: a "
     "folder with blimp.jsonl.gz and models_summary.jsonl"),
    (["/nonexistent/run"], "glm5lab eval: error: RUN_OR_CHECKPOINT = '/nonexistent/run' is not allowed: a run folder or a "
     "checkpoint folder (it does not exist)"),
    ([], "glm5lab eval: error: give exactly one model: RUN_OR_CHECKPOINT"),
    (["{ckpt}", "--batch-size", "0"], "glm5lab eval: error: --batch-size"),
    (["--hf", "/nonexistent/hf"], "glm5lab eval: error: --hf /nonexistent/hf is not allowed: a transformers model"),
    (["{ckpt}", "--out", "{ckpt}"], "glm5lab eval: error: --out {ckpt} is not allowed: a JSON file path (it is a "
     "folder: give e.g. {ckpt}/blimp.json)"),
])
def test_bad_input_is_refused_in_one_line(capsys, glm5lab_folder, args, line):
    status, out, err = cli(capsys, *[a.format(ckpt=glm5lab_folder) for a in args])
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(line.format(ckpt=glm5lab_folder)), err


def test_batched_glm5lab_scores_equal_one_sentence_at_a_time(glm5lab_folder):
    """Right padding must not reach a real position through attention, DSA's top-k or the MoE router."""
    from glm5lab.evals.causal_lm import glm5lab_lm

    lm = glm5lab_lm(glm5lab_folder, device="cpu")
    seqs = [[lm.prefix, *lm.encode(s)] for pair in SENTENCES for s in pair]
    alone = [sequence_logprobs(lm.logits_fn, [s])[0] for s in seqs]
    assert len({len(s) for s in seqs}) > 1
    assert sequence_logprobs(lm.logits_fn, seqs, batch_size=4) == pytest.approx(alone, abs=1e-4)
