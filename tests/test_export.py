"""`glm5lab export`: a one-process run checkpoint or run folder -> an HF safetensors folder with the tensors
`save_pretrained` writes, sharded by --max-shard-size; refusals in one line. A distributed run's checkpoint, with
transformers' logits, is tested with the distributed runs (`tests/train/test_sharded_checkpoint.py`), an HF step
folder of the former layout in `tests/train/test_run_start.py`."""

import json

import pytest
import torch

from glm5lab import GLM5ForCausalLM
from glm5lab.cli import main
from glm5lab.checkpoints.dcp import save
from glm5lab.checkpoints.export import export_checkpoint, load_checkpoint_model, parse_size
from glm5lab.hf import read_checkpoint
from glm5lab.data.tokenizer import load_tokenizer, train_tokenizer


@pytest.fixture
def run(tiny_model, tmp_path):
    """A run folder as one process leaves it: RUN/checkpoints/step-000002 (a run checkpoint + tokenizer) and `latest`;
    tmp_path/saved: the model's `save_pretrained`."""
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    tokenizer = train_tokenizer(["the king and the queen of denmark"] * 20, 300, tmp_path / "tok.json")
    save(step, tiny_model, torch.optim.AdamW(tiny_model.parameters()),
         {"position": {"step": 2, "stage": 1, "in_stage": 0}, "ep": 1}, tokenizer=tokenizer)
    (step.parent / "latest").write_text("step-000002\n")
    tiny_model.save_pretrained(tmp_path / "saved")
    return tmp_path / "run"


def test_export_of_a_run_folder_writes_the_save_pretrained_tensors_in_shards(run, tiny_model, tmp_path):
    out = export_checkpoint(run, tmp_path / "out", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= \
        {p.name for p in out.iterdir()}
    assert load_tokenizer(out).to_str() == load_tokenizer(run / "checkpoints" / "step-000002").to_str()
    ours, theirs = read_checkpoint(out), read_checkpoint(tmp_path / "saved")
    assert ours.keys() == theirs.keys() == index["weight_map"].keys()
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
    loaded = GLM5ForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in loaded.items())
    assert load_checkpoint_model(run).state_dict().keys() == loaded.keys()
    export_checkpoint(run, out)  # again over the earlier export, default 5GB: one shard, the old ones gone
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]  # as save_pretrained
    assert not (out / "model.safetensors.index.json").exists()


def test_refusals_are_one_line_naming_the_argument(run, tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    cases = [
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "o")], "CHECKPOINT = '.*missing' is not allowed: a run "
         "folder or a checkpoint folder \\(it does not exist\\)"),
        ([str(tmp_path / "notes"), "--out", str(tmp_path / "o")], "CHECKPOINT = '.*notes' is not allowed: a run "
         "folder \\(with checkpoints/latest\\) or a checkpoint folder .*it is neither"),
        ([str(run), "--out", str(tmp_path / "notes")], "--out = '.*notes' is not allowed: a new or empty folder, or "
         "an earlier export"),
        ([str(run), "--out", str(tmp_path / "o"), "--max-shard-size", "5 parsecs"],
         "--max-shard-size = '5 parsecs' is not allowed: a size such as 5GB"),
    ]
    import re

    for argv, message in cases:
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search("^glm5lab export: error: " + message, err), err
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine" and not (tmp_path / "o").exists()


def test_cli_export_prints_where_it_wrote(run, tmp_path, capsys):
    assert main(["export", str(run), "--out", str(tmp_path / "o"), "--max-shard-size", "300KB"]) == 0
    assert capsys.readouterr().out == f"export: {run / 'checkpoints' / 'step-000002'} -> {tmp_path / 'o'}\n"
    assert len(list((tmp_path / "o").glob("model-*.safetensors"))) > 1


def test_parse_size_reads_transformers_units():
    assert [parse_size(s) for s in ("5GB", "500MB", "2GiB", "100kb", "123")] == \
        [5 * 10**9, 500 * 10**6, 2 * 2**30, 100_000, 123]
