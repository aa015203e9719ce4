"""`glm5lab.environment`: the facts every run, result, report and benchmark records."""

from __future__ import annotations

import re
import subprocess

from glm5lab.environment import env_facts, environment, git_commit, load_average


def test_git_commit_names_this_checkout_and_marks_uncommitted_changes(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    commit = git_commit()
    if head:  # a git checkout (an editable install): HEAD, plus a tag when tracked files differ
        assert re.fullmatch(re.escape(head) + r"(\+uncommitted:[0-9a-f]{12})?", commit), commit
    assert git_commit(tmp_path) == "unknown"  # not a checkout


def test_env_facts_and_environment_fields():
    facts = env_facts("cpu")
    assert set(facts) == {"date_utc", "torch", "python", "cpu_model", "cpu_count", "torch_threads",
                          "load_average_start", "git_commit", "device", "transformers"}
    assert facts["device"] == "cpu" and facts["torch_threads"] >= 1
    avg = load_average()
    assert avg is None or len(avg) == 3
    env = environment()
    assert {"python", "platform", "cpu", "cpu_count", "gpu", "cuda", "libraries"} <= set(env)
    assert env["cpu"] == facts["cpu_model"] and env["libraries"]["torch"]
