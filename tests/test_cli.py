"""`glm5lab ledger` as a user runs it: `python -m glm5lab` in a subprocess; exit codes, the JSON
last line, and one-line error messages (no traceback) for the mistakes a user can make."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from glm5lab import ModelConfig
from glm5lab.cli import main
from glm5lab.ledger import CONVENTIONS, ledger


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm5lab", *args], capture_output=True, text=True, timeout=120)


def test_ledger_glm5_prints_table_and_json_last_line():
    r = run("ledger", "--preset", "glm5", "--json", "--context", "131072")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    d = json.loads(lines[-1])
    assert d["total_params"] == 753_864_119_552 and d["activated_params"] == 42_375_943_424
    assert d["with_embeddings_without_mtp"]["total"] == 743_911_199_232
    assert d["without_embeddings_with_mtp"] == {"total": 751_960_954_112, "activated": 40_472_777_984}
    assert set(CONVENTIONS) <= set(d)
    assert d["state"]["context"] == 131072 and d["state"]["per_layer_values"]["mla"] == 576
    table = "\n".join(lines[:-1])
    assert "743,911,199,232" in table and "Convention that matches the report" in table


def test_ledger_reads_a_config_file_and_a_checkpoint_folder(tmp_path):
    cfg = ModelConfig.from_preset("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    expected = ledger(cfg, dtype="fp8", context=100)
    for path in (tmp_path / "config.json", tmp_path):
        r = run("ledger", "--config", str(path), "--dtype", "fp8", "--context", "100", "--json")
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout.strip().splitlines()[-1])
        assert d["name"] == str(path)
        assert {k: v for k, v in d.items() if k != "name"} == {k: v for k, v in expected.items() if k != "name"}
        assert d["state"]["bytes_per_value"] == 1


def test_ledger_index_dtype_flag():
    r = run("ledger", "--preset", "glm5", "--index-dtype", "fp8", "--context", "1000", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["state"] == ledger(ModelConfig.from_preset("glm5"), context=1000, index_dtype="fp8")["state"]
    assert d["state"]["main"]["bytes_per_token"] == 78 * (576 * 2 + 128 + 4)
    assert "indexer keys fp8, 1 B/value + a 4 B scale per token per layer" in r.stdout
    r = run("ledger", "--preset", "glm5", "--index-dtype", "fp8", "--gpus", "8", "--ep", "8", "--mode", "serve")
    assert r.returncode == 2 and "--index-dtype = 'fp8' is not allowed: only for the ledger table" in r.stderr


def test_table_without_json_has_no_json_line():
    r = run("ledger", "--preset", "tiny")
    assert r.returncode == 0 and not r.stdout.strip().splitlines()[-1].startswith("{")


@pytest.mark.parametrize("setup, args, message", [
    (None, ["--preset", "glm6"], "unknown preset 'glm6'"),
    (None, ["--config", "{tmp}/missing.json"], "no config.json at"),
    (("bad.json", "{not json"), ["--config", "{tmp}/bad.json"], "is not valid JSON"),
    (("other.json", '{"model_type": "llama"}'), ["--config", "{tmp}/other.json"], "`model_type` = 'llama'"),
    (("list.json", "[1, 2]"), ["--config", "{tmp}/list.json"], "must hold a JSON object, got list"),
    (None, ["--preset", "tiny", "--context", "0"], "context 0 is not allowed"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, setup, args, message):
    if setup:
        (tmp_path / setup[0]).write_text(setup[1])
    r = run("ledger", *[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("glm5lab ledger: error: ") and message in r.stderr


def test_main_in_process(capsys):
    assert main(["ledger", "--preset", "gqa-8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["state"]["per_layer_values"]["gqa"] == 2048
    with pytest.raises(SystemExit) as e:
        main(["ledger", "--dtype", "int4"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_help_is_written_for_users(capsys):
    from glm5lab.cli import build_parser

    top = build_parser().format_help()
    assert "thin over the library" not in top and "GLM-5" in top
    assert "ledger" in top
    with pytest.raises(SystemExit):
        main(["ledger", "-h"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "larger values are refused" in help_text


def test_ledger_note_and_per_layer_entries_follow_the_config():
    r = run("ledger", "--preset", "tiny", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    d = json.loads(lines[-1])
    assert "Convention that matches the report" not in r.stdout
    assert "GLM-5 and GLM-4.5 reports state" in " ".join(r.stdout.split())
    assert "gqa" not in d["state"]["per_layer_values"]
    assert {"total_params", "activated_params", *CONVENTIONS} <= set(d)


def test_long_error_messages_are_cut_to_one_readable_line():
    from glm5lab.cli import _one_line

    assert _one_line(ValueError("a\n  b")) == "a b"
    long = _one_line(ValueError("k" * 5000), limit=100)
    assert long.startswith("k" * 100) and long.endswith("(4900 more characters)")


def test_cli_starts_without_torch_and_interrupts_cleanly(monkeypatch, capsys):
    """`glm5lab --help` and ledger do not load torch (the package imports the model lazily), so a
    Ctrl-C at start-up is caught by `main` (exit 130, one line) rather than torch's import."""
    import glm5lab.cli as cli

    code = "import sys, glm5lab.cli, glm5lab; assert 'torch' not in sys.modules; glm5lab.GLM5ForCausalLM; " \
           "assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "ledger", interrupted)
    assert cli.main(["ledger", "--preset", "tiny"]) == 130
    assert capsys.readouterr().err.strip() == "glm5lab ledger: interrupted"
