"""A torchrun rank's tie to its launcher: the rank ends when torchrun dies, however it dies, even during start-up.

torchrun starts each rank as its own child in a new session, so nothing else stops the ranks of a killed launcher
(SIGKILL included): they would retry the launcher's store for 30 minutes, or train on, holding the run folder.
`exit_with_launcher` ties them: `glm5lab.cli.main` calls it first of all in a torchrun rank (before the command
line is parsed and before torch is imported: this module is torch-free), and `glm5lab.parallel.dist.setup` again for
the library's own callers. Source: prctl(2) PR_SET_PDEATHSIG; torch.distributed.elastic's agent store
(TORCHELASTIC_USE_AGENT_STORE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import os
import signal
import socket
import sys

PROBE_TIMEOUT_S = 2.0
"""How long `launcher_gone` waits for the launcher's store to accept a connection (a timeout decides nothing)."""

_armed = False


def exit_with_launcher() -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set), make this rank exit (SIGTERM) when its launcher dies, and at once
    when it already has (`launcher_gone`, probed once, when the tie is made: a later death sends the signal).
    Linux: prctl(PR_SET_PDEATHSIG), sent when the thread that started this process ends (torchrun's main thread,
    which starts its ranks and lives as long as the launcher); other systems: a watchdog thread that checks the
    parent pid every second. Idempotent; a no-op without torchrun."""
    global _armed
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if not _armed:
        _armed = True
        parent = os.getppid()
        if sys.platform.startswith("linux"):
            import ctypes

            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        else:
            import threading
            import time

            def watch() -> None:
                while os.getppid() == parent:
                    time.sleep(1.0)
                os.kill(os.getpid(), signal.SIGTERM)

            threading.Thread(target=watch, name="glm5lab-launcher-watch", daemon=True).start()
        if launcher_gone():  # it died before the tie was made: the kernel will not send the signal now
            os.kill(os.getpid(), signal.SIGTERM)


def launcher_gone() -> bool:
    """Whether the run's launcher is known to be dead: the store torchrun's agent holds for the whole run
    (TORCHELASTIC_USE_AGENT_STORE=True; at MASTER_ADDR:MASTER_PORT, listening before any rank is started) refuses
    connections, so no rank can ever join the run (they would retry it for 30 minutes). A live store, no agent
    store, or one that does not answer within PROBE_TIMEOUT_S (a network fault: torch's own retries decide) is not
    taken as a death.

    Not the parent pid: a dead launcher's ranks go to the nearest subreaper (systemd --user, a container's init),
    not always to pid 1, and in a container whose pid 1 is torchrun itself a parent of 1 is the live launcher. Not
    seen: on several hosts, the launcher of a host other than the store's, dead before its ranks got here (they are
    left to torch's rendezvous, as before)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return False
    try:
        with socket.create_connection((addr, int(port)), timeout=PROBE_TIMEOUT_S, all_errors=True):
            return False
    except ExceptionGroup as failed:  # one error per address MASTER_ADDR resolves to: every one refused
        return all(isinstance(e, ConnectionRefusedError) for e in failed.exceptions)
    except OSError:  # the name does not resolve here
        return False
