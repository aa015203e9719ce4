"""What a command says on stderr besides its result, said once per run: under torchrun every rank runs the same
command, and only the main rank (RANK 0) speaks, so a notice is not printed once per process. Torch-free (the CLI's
start, `glm5lab tokenize`)."""

from __future__ import annotations

import os
import sys


def is_main_process() -> bool:
    """Whether this process speaks for the run (RANK 0, or no torchrun): usable before a process group exists and
    after it is gone."""
    return int(os.environ.get("RANK", "0")) == 0


def say(line: str) -> None:
    """Print the one-line notice `line` on stderr (flushed: it lands above a progress bar), on the main process
    only."""
    if is_main_process():
        print(line, file=sys.stderr, flush=True)
