"""What a command says on stderr besides its result, said once per run: under torchrun every rank runs the same
command, and only the main rank (RANK 0) speaks, so a notice is not printed once per process. Torch-free (the CLI's
start, `glm5lab tokenize`)."""

from __future__ import annotations

import os
import sys
import time


def is_main_process() -> bool:
    """Whether this process speaks for the run (RANK 0, or no torchrun): usable before a process group exists and
    after it is gone."""
    return int(os.environ.get("RANK", "0")) == 0


def say(line: str) -> None:
    """Print the one-line notice `line` on stderr (flushed: it lands above a progress bar), on the main process
    only."""
    if is_main_process():
        print(line, file=sys.stderr, flush=True)


MAIN_GRACE_S = 10.0
"""How long a torchrun rank other than rank 0 that refuses waits for rank 0 to refuse too (`say_refusal`)."""


def say_refusal(line: str) -> None:
    """Print the refusal `line` on stderr once per run. Every torchrun rank checks the same arguments, and rank 0
    speaks for the run: it prints at once. Another torchrun rank first gives rank 0 MAIN_GRACE_S seconds to refuse
    and exit (torchrun then stops this rank with SIGTERM: had it exited first, torchrun could stop rank 0 before it
    printed, leaving the line only in torchrun's failure table), and prints the line itself only when it is still
    running after that (rank 0 did not refuse the same way). One process: printed at once."""
    if not is_main_process():
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            return
        time.sleep(MAIN_GRACE_S)
    print(line, file=sys.stderr, flush=True)
