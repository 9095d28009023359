"""The test session's ``python``: ``python [-u] -m MODULE args...`` for a module in :data:`FORKABLE` runs in a process
forked from the session's fork server (:mod:`tests.forkserver`), which has imported it already; any other command
line is the real interpreter's (``exec``).

The server writes a shell script that runs ``python -S tests/forkclient.py SOCKET "$@"`` and names it as the
``python`` of its forked processes, so a launcher they start (Lightning's for the CLI's other ranks, torchrun's for
its workers) forks its processes too; ``-S``: this client imports the standard library only and starts in
milliseconds. It stands in for the process it asks for: it hands the server its standard streams, environment,
working directory and arguments; relays the signals it gets to the forked process's group (a terminal's Ctrl-C, a
launcher's SIGTERM); and exits as that process did (its code, or death by its signal). The server kills the forked
process's group when its client dies; a forked process dies with the server, and the client then ends as if killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys

# ``lightning_ulysses.__main__``: Lightning starts the CLI's other ranks with ``-m __main__.__spec__.name``
FORKABLE = ("lightning_ulysses", "lightning_ulysses.__main__", "tests.launch", "torch.distributed.run")
OPTIONS = ("-u",)  # interpreter options a forked process honours (``torchrun`` passes ``-u``)
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def forkable(argv: list[str]) -> bool:
    """Whether ``python argv...`` runs a module the server can fork."""
    first = 0
    while first < len(argv) and argv[first] in OPTIONS:
        first += 1
    return len(argv) > first + 1 and argv[first] == "-m" and argv[first + 1] in FORKABLE


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    if not forkable(argv):
        os.execv(sys.executable, [sys.executable, *argv])
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)  # held until there is a process to relay them to
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as server:
        server.connect(path)
        job = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(server, [json.dumps(job).encode()], [0, 1, 2])
        pid = int(server.recv(64))  # sent once the process leads its own group

        def relay(signum: int, frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):  # it has exited; its exit code is on its way
                os.killpg(pid, signum)

        for signum in RELAYED:
            signal.signal(signum, relay)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
        answer = server.recv(64)
    code = int(answer) if answer else -signal.SIGKILL  # no answer: the server died, and its processes with it
    if code < 0:
        if -code in RELAYED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
