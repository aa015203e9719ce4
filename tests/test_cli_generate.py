"""`glm5lab generate`: the CLI gives what `glm5lab.generate` gives (greedy, sampled, speculative,
chunked prefill), streams the same text it reports, finds the checkpoint in a run folder, and
answers each user mistake with one line and exit status 2. In-process through `cli.main`
(fast), plus one subprocess smoke test. Tiny preset, a few new tokens per run."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig, generate
from glm5lab.cli import main
from glm5lab.cli.generate import Stream, parse_stops
from glm5lab.data.tokenizer import load_tokenizer, train_tokenizer

N = 5  # new tokens per CLI run
PROMPT = "Hello world"
TEXTS = ["Hello world, naïve café 日本語 — the quick brown fox jumps over the lazy dog. " * 8]


def _model(seed: int, **changes) -> GLM5ForCausalLM:
    torch.manual_seed(seed)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny").replace(**changes))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """tiny model + tokenizer ("ckpt"), the same weights without a tokenizer ("bare"), a model
    without MTP ("nomtp"), and a run folder whose `latest` is step-000002 ("run")."""
    root = tmp_path_factory.mktemp("gen")
    ckpt = root / "ckpt"
    _model(0).save_pretrained(ckpt)
    train_tokenizer(TEXTS, 400, ckpt)
    bare = root / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ckpt / name, bare / name)
    _model(1, num_nextn_predict_layers=0).save_pretrained(root / "nomtp")
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text((ckpt / "config.json").read_text())  # train writes one at the top too
    _model(2).save_pretrained(run / "checkpoints" / "step-000001")
    shutil.copytree(ckpt, run / "checkpoints" / "step-000002")
    (run / "checkpoints" / "step-000002" / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    return {"ckpt": ckpt, "bare": bare, "nomtp": root / "nomtp", "run": run, "root": root}


@pytest.fixture(scope="module")
def reference(folders):
    """The library's greedy output for PROMPT on the checkpoint: (prompt ids, new tokens, tokenizer)."""
    tok = load_tokenizer(folders["ckpt"])
    model = GLM5ForCausalLM.from_pretrained(folders["ckpt"], mtp=False)
    ids = tok.encode(PROMPT).ids
    return ids, generate(model, ids, N).tokens[0], tok


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main(["generate", "--device", "cpu", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def cli_json(capsys, *args) -> dict:
    rc, out, err = cli(capsys, *args, "--json")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_greedy_equals_the_library(capsys, folders, reference):
    ids, tokens, tok = reference
    d = cli_json(capsys, "--model", folders["ckpt"], "--prompt", PROMPT, "--max-new-tokens", N)
    assert d["prompt_ids"] == ids and d["tokens"] == tokens
    assert d["text"] == tok.decode(tokens, skip_special_tokens=False)
    stats = d["stats"]
    assert stats["new_tokens"] == N and stats["prompt_tokens"] == len(ids) and stats["prefill_seconds"] > 0
    assert stats["acceptance_length"] is None and stats["decode_tokens_per_second"] > 0


def test_sampling_and_prefill_chunk_options_reach_the_library(capsys, folders, reference):
    ids, _, _ = reference
    model = GLM5ForCausalLM.from_pretrained(folders["ckpt"], mtp=False)
    opts = {"temperature": 0.9, "top_k": 50, "top_p": 0.8, "seed": 7, "prefill_chunk": 1}
    expected = generate(model, ids, N, **opts).tokens[0]
    d = cli_json(capsys, "--model", folders["ckpt"], "--prompt", PROMPT, "--max-new-tokens", N, "--temperature",
                 0.9, "--top-k", 50, "--top-p", 0.8, "--seed", 7, "--prefill-chunk", 1)
    assert d["tokens"] == expected


@pytest.mark.parametrize("flag, value, library, bad, error", [
    # "auto" is the default prefill chunk: the same tokens as the library's default
    ("--prefill-chunk", "auto", {}, "big", "argument --prefill-chunk: 'big': an integer >= 1 or \"auto\""),
    ("--index-cache-dtype", "fp8", {"index_cache_dtype": "fp8"}, "int8", "--index-cache-dtype: invalid choice: 'int8'"),
])
def test_a_word_flag_reaches_the_library_and_other_words_are_refused(capsys, folders, reference, flag, value, library,
                                                                     bad, error):
    ids, _, _ = reference
    model = GLM5ForCausalLM.from_pretrained(folders["ckpt"], mtp=False)
    expected = generate(model, ids, N, **library).tokens[0]
    d = cli_json(capsys, "--model", folders["ckpt"], "--prompt", PROMPT, "--max-new-tokens", N, flag, value)
    assert d["tokens"] == expected
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(folders["ckpt"]), "--prompt", PROMPT, flag, bad])
    assert e.value.code == 2 and error in capsys.readouterr().err


def test_stop_token_ends_generation(capsys, folders, reference):
    _, tokens, _ = reference
    stop = tokens[2]
    d = cli_json(capsys, "--model", folders["ckpt"], "--prompt", PROMPT, "--max-new-tokens", N, "--stop", 511, stop)
    assert d["tokens"] == tokens[:tokens.index(stop) + 1]


def test_speculative_greedy_gives_the_same_tokens_and_reports_acceptance(capsys, folders, reference):
    _, tokens, tok = reference
    rc, out, err = cli(capsys, "--model", folders["ckpt"], "--prompt", PROMPT, "--max-new-tokens", N,
                       "--speculative", "mtp", "--draft-steps", 2)
    assert rc == 0, err
    assert out == tok.decode(tokens, skip_special_tokens=False) + "\n"
    stats_line = err.strip().splitlines()[-1]
    assert f"{N} new tokens" in stats_line and "tok/s" in stats_line and "prefill" in stats_line
    assert "acceptance length" in stats_line and "acceptance rate per draft position" in stats_line
    rates = stats_line.split("per draft position:")[1].split()
    assert len(rates) == 2 and all(0 <= float(r) <= 1 for r in rates)


def test_compile_gives_the_same_tokens_and_reports_the_compile_time(capsys, folders, reference, monkeypatch):
    from glm5lab.infer import compiled

    monkeypatch.setattr(compiled, "CPU_OPTIONS", {})  # the Python wrapper: compiles faster, same tokens
    _, tokens, _ = reference
    d = cli_json(capsys, "--model", folders["ckpt"], "--prompt", PROMPT, "--max-new-tokens", N, "--compile")
    assert d["tokens"] == tokens
    st = d["stats"]
    assert st["compile_seconds"] >= 0 and st["decode_tokens_per_second"] > 0
    # compile time is reported apart: the decode seconds are the ones the tok/s divides by
    decoded = st["new_tokens"] - st["rows"] - st["compile_tokens"]  # the first token comes from the prefill
    assert st["compile_tokens"] >= 1 if st["compile_seconds"] else st["compile_tokens"] == 0
    assert st["decode_tokens_per_second"] == pytest.approx(decoded / st["decode_seconds"])


def test_the_stats_line_reports_compile_time_apart_from_decode():
    from glm5lab.cli.generate import format_stats
    from glm5lab.infer.generate import GenerateStats

    line = format_stats(GenerateStats(prompt_tokens=4, new_tokens=11, decode_seconds=0.5, compile_seconds=20.0,
                                      compile_tokens=1))
    assert line.startswith("11 new tokens, decode 18.0 tok/s (0.500 s), prefill")  # 11 - 1 (prefill) - 1 (compiled)
    assert line.endswith("compile 20.0 s (the rounds that compiled, 1 token: apart, in neither the decode seconds "
                         "nor the tok/s)")


def test_speculative_json_stats(capsys, folders, reference):
    _, tokens, _ = reference
    d = cli_json(capsys, "--model", folders["ckpt"], "--prompt", PROMPT, "--max-new-tokens", N,
                 "--speculative", "mtp")
    s = d["stats"]
    assert d["tokens"] == tokens
    assert len(s["acceptance_rate"]) == 3 and s["verify_steps"] >= 1
    assert s["acceptance_length"] == pytest.approx(1 + sum(s["acceptance_rate"]))


def test_speculative_run_without_a_verify_step(capsys, folders):
    rc, out, err = cli(capsys, "--model", folders["bare"], "--prompt-ids", "1 2", "--max-new-tokens", 1,
                       "--speculative", "mtp")
    assert rc == 0 and len(out.split()) == 1
    assert "1 new token," in err and "no verify step" in err


def test_streamed_text_equals_the_final_text(capsys, folders, reference):
    _, tokens, tok = reference
    rc, out, err = cli(capsys, "--model", folders["ckpt"], "--prompt", PROMPT, "--max-new-tokens", N)
    assert rc == 0, err
    assert out == tok.decode(tokens, skip_special_tokens=False) + "\n"
    assert "new tokens" in err and "acceptance" not in err


class Chunks(io.StringIO):
    def __init__(self):
        super().__init__()
        self.chunks = []

    def write(self, s):
        self.chunks.append(s)
        return super().write(s)


def test_stream_prints_multibyte_characters_whole(folders):
    tok = load_tokenizer(folders["ckpt"])
    text = "naïve 日本語 café"
    out = Chunks()
    stream = Stream(tok, out)
    # one id per byte: every non-ASCII character is split over several tokens
    ids = [tok.token_to_id(c) for c in _byte_symbols(text)]
    assert None not in ids
    for i in ids:
        stream.add([i])
    stream.close()
    assert out.getvalue() == text + "\n"
    assert all("\ufffd" not in c for c in out.chunks)
    assert "日" in out.chunks and "本" in out.chunks  # each printed once complete


def _byte_symbols(text: str) -> list[str]:
    """GPT-2 byte-level symbols of `text`, one per byte."""
    from tokenizers import pre_tokenizers

    return [sym for piece, _ in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            .pre_tokenize_str(text) for sym in piece]


def test_stream_without_tokenizer_prints_ids():
    out = io.StringIO()
    stream = Stream(None, out)
    stream.add([3, 4])
    stream.add([])
    stream.add([5])
    stream.close()
    assert out.getvalue() == "3 4 5\n"


def test_prompt_ids_without_tokenizer_print_ids(capsys, folders, reference):
    ids, tokens, _ = reference
    rc, out, err = cli(capsys, "--model", folders["bare"], "--prompt-ids", " ".join(map(str, ids)),
                       "--max-new-tokens", N)
    assert rc == 0, err
    assert out == " ".join(map(str, tokens)) + "\n"
    d = cli_json(capsys, "--model", folders["bare"], "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", N)
    assert d["tokens"] == tokens and d["text"] is None


def test_run_folder_uses_the_latest_checkpoint(capsys, folders, reference):
    _, tokens, _ = reference
    rc, out, err = cli(capsys, "--model", folders["run"], "--prompt", PROMPT, "--max-new-tokens", N, "--json")
    assert rc == 0, err
    assert json.loads(out)["tokens"] == tokens  # step-000002 holds the reference weights, step-000001 others
    assert "step-000002" in err.splitlines()[0]


def test_parse_stops(folders):
    tok = load_tokenizer(folders["ckpt"])
    assert parse_stops(["<|endoftext|>", "7", "H"], tok) == [0, 7, tok.token_to_id("H")]


def _mtp_declared_without_weights(folders) -> Path:
    folder = folders["root"] / "mtp-no-weights"
    if not folder.exists():
        shutil.copytree(folders["nomtp"], folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["num_nextn_predict_layers"] = 1
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _foreign(folders) -> Path:
    folder = folders["root"] / "llama"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _run_without_latest(folders) -> Path:
    folder = folders["root"] / "fresh-run"
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    return folder


ERRORS = [
    (lambda f: f["root"] / "missing", [], "is not allowed: a run folder or a checkpoint folder (it does not exist)"),
    (lambda f: f["ckpt"] / "config.json", [], "is a file"),
    (lambda f: f["root"], [], "has no config.json"),
    (_run_without_latest, [], "no checkpoints/latest"),
    (_foreign, [], "`model_type` = 'llama'"),
    # the values generate() takes are its own checks: the message names its argument and the value
    (lambda f: f["ckpt"], ["--temperature", "-1"], "temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (lambda f: f["ckpt"], ["--temperature", "nan"], "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (lambda f: f["ckpt"], ["--top-p", "0", "--temperature", "1"], "top_p must be None or a number in (0, 1], got 0.0"),
    (lambda f: f["ckpt"], ["--top-k", "0", "--temperature", "1"], "top_k must be None or an int in 1..vocab_size=512, got 0"),
    (lambda f: f["ckpt"], ["--top-k", "513", "--temperature", "1"], "top_k must be None or an int in 1..vocab_size=512, got 513"),
    # restricting greedy decoding: refused in the CLI's names, before the model folder is even read
    (lambda f: f["root"] / "missing", ["--top-k", "5"], "--top-k 5 restricts sampling, but --temperature is 0 (greedy, "
     "the default): add --temperature T > 0 (e.g. --temperature 0.8), or drop --top-k"),
    (lambda f: f["ckpt"], ["--top-k", "5", "--top-p", "0.9"], "--top-k 5 and --top-p 0.9 restrict sampling"),
    (lambda f: f["ckpt"], ["--max-new-tokens", "0"], "max_new_tokens = 0 is not allowed: an integer >= 1"),
    (lambda f: f["ckpt"], ["--prefill-chunk", "0"], "--prefill-chunk = 0 is not allowed: an integer >= 1"),
    (lambda f: f["ckpt"], ["--speculative", "mtp", "--draft-steps", "0"], "draft_steps = 0 is not allowed: an integer >= 1"),
    (lambda f: f["ckpt"], ["--draft-steps", "2"], "--draft-steps applies only with --speculative"),
    # prompts that overflow with a single new token: the library stops the run before it starts
    # (rather than decoding 2000 tokens)
    (lambda f: f["ckpt"], ["--prompt-ids", "1 " * 2048, "--max-new-tokens", "1"],
     "the longest prompt (2048 tokens) + max_new_tokens=1 = 2049 exceeds max_position_embeddings=2048"),
    (lambda f: f["ckpt"], ["--prompt-ids", "1 " * 2044, "--max-new-tokens", "1", "--speculative", "mtp"],
     "(2044 tokens) + max_new_tokens=1 + draft_steps+1=4 = 2049 exceeds"),
    (lambda f: f["ckpt"], ["--stop", "quick brown fox"], "a stop must be a single token"),
    (lambda f: f["ckpt"], ["--stop", "600"], "stop_tokens must be token ids in [0, vocab_size=512), got [600]"),
    (lambda f: f["ckpt"], ["--tokenizer", "/no/such/tok.json"], "no tokenizer at /no/such/tok.json"),
    (lambda f: f["bare"], [], "no tokenizer.json: pass --tokenizer FILE, or give the prompt as token ids with "
     "--prompt-ids"),
    (lambda f: f["ckpt"], ["--prompt", ""], "--prompt encodes to no tokens"),
    (lambda f: f["bare"], ["--prompt-ids", "1 x"], "integers separated by spaces"),
    (lambda f: f["bare"], ["--prompt-ids", "1 600"], "token ids outside [0, vocab_size=512): [600]"),
    (lambda f: f["bare"], ["--prompt-ids", " "], "--prompt-ids is empty"),
    (lambda f: f["bare"], ["--stop", "<|endoftext|>", "--prompt-ids", "1"], "text needs a tokenizer"),
    (lambda f: f["nomtp"], ["--speculative", "mtp", "--prompt-ids", "1"], "speculative='mtp' needs an MTP layer"),
    (_mtp_declared_without_weights, ["--speculative", "mtp", "--prompt-ids", "1"], "needs the MTP layer's weights"),
]


@pytest.mark.parametrize("where, args, message", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_user_errors_are_one_line_and_exit_2(capsys, folders, where, args, message):
    prompt = [] if {"--prompt", "--prompt-ids"} & set(args) else ["--prompt", PROMPT]
    rc, out, err = cli(capsys, "--model", where(folders), *prompt, *args)
    assert rc == 2, err
    assert out == ""
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("glm5lab generate: error: ") and message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is absent")
def test_cuda_request_without_cuda(capsys, folders):
    rc = main(["generate", "--model", str(folders["ckpt"]), "--prompt", "x", "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and "--device cuda: no CUDA device is available" in err


def test_ctrl_c_exits_130_after_printing_what_came(capsys, folders, monkeypatch):
    import glm5lab.infer.generate as gen

    def interrupted(*args, on_tokens, **kw):
        on_tokens([[7, 8]])
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "generate", interrupted)
    rc, out, err = cli(capsys, "--model", folders["bare"], "--prompt-ids", "1 2")
    assert rc == 130 and out == "7 8\n" and err.strip() == "glm5lab generate: interrupted"


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "-h"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--model DIR", "--prompt TEXT", "--prompt-ids", "--tokenizer FILE", "--max-new-tokens N",
                   "--temperature T", "--top-k K", "--top-p P", "--seed S", "--stop TEXT_OR_ID", "--speculative {mtp}",
                   "--draft-steps N", "--device {cpu,cuda}", "--dtype {fp32,bf16}", "--prefill-chunk N", "--compile",
                   "--index-cache-dtype {auto,fp8}", "--json"):
        assert option in text, option
    assert "(default 64)" in text and "0 = greedy" in text


def test_subprocess_smoke(folders):
    r = subprocess.run([sys.executable, "-m", "glm5lab", "generate", "--model", str(folders["bare"]),
                        "--prompt-ids", "1 2 3", "--max-new-tokens", "3", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 3 and all(t.isdigit() for t in r.stdout.split())
    assert "3 new tokens" in r.stderr and "Traceback" not in r.stderr


def test_request_errors_come_before_the_weights_load(capsys, folders, monkeypatch):
    import glm5lab.cli.generate as cli_generate

    def no_loading(*args, **kw):
        raise AssertionError("weights were loaded before the request was checked")

    monkeypatch.setattr(cli_generate, "load_model", no_loading)
    for args, message in ((["--max-new-tokens", "0"], "max_new_tokens = 0 is not allowed: an integer >= 1"),
                          (["--top-k", "513", "--temperature", "1"], "top_k must be None or an int in 1..vocab_size=512, got 513"),
                          (["--top-p", "0.5"], "--top-p 0.5 restricts sampling, but --temperature is 0"),
                          (["--stop", "600"], "stop_tokens must be token ids in [0, vocab_size=512), got [600]")):
        rc, out, err = cli(capsys, "--model", folders["ckpt"], "--prompt", PROMPT, *args)
        assert rc == 2 and message in err, err
