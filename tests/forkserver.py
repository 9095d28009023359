"""A fork server for :mod:`tests.launch`: one process that has imported torch, Lightning, DeepSpeed, transformers and
the package, and forks every rank of the test session's process worlds from that state.

A rank started with ``python -m tests.launch`` spends ~8 s of CPU importing before the first line of its test runs;
a forked rank starts in milliseconds, with the memory of those imports shared copy-on-write. Every call still gets
new processes: nothing one test does reaches another, and a test may kill, signal or fail its ranks as it would
fresh ones. The forked rank then runs exactly what a fresh one runs (:func:`tests.launch.main`), with the launcher's
environment, working directory and arguments, its own session (process group) and its output in its log file; it
exits through the interpreter's normal shutdown (exit handlers, an uncaught ``KeyboardInterrupt`` as SIGINT).

What a fresh process reads from its environment while importing is read again after the fork where it differs
between ranks (Lightning's ``rank_zero_only.rank``); what is read at process start (``MALLOC_*``) cannot be, so
:func:`tests.launch.launch` starts those with ``extra_env`` as fresh processes, and torchrun and srun launchers too.

The server forks only while it is fork-safe: one thread and no CUDA context. Where its imports leave more (a build
whose import starts threads), it says so and exits, and ranks are started as fresh processes.

Protocol (one JSON object a line): the parent sends ``{"argv", "env", "cwd", "log", "exit"}``; the server answers
with the child's pid, and writes the child's exit code (``-N`` for signal N, as ``Popen.returncode``) to the file
``exit`` when it has reaped it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

PRELOAD = (
    "torch",
    "torch.distributed",
    "lightning",
    "lightning.pytorch",
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # its first fit imports it, and with it dynamo and inductor (~2 s)
    "transformers",
    "transformers.models.llama.modeling_llama",
    "lightning_ulysses",
    "pytest",
    "tests.launch",
    "tests.tiny",
)
"""Imported once by the server: what (nearly) every rank imports first."""
SET_AFTER_FORK = {"MALLOC_MMAP_THRESHOLD_": -3}  # glibc reads it at process start; a forked rank calls mallopt
READY = "ready"
POLL_S = 0.02


class ForkedProcess:
    """The parent's handle on a forked rank: the part of :class:`subprocess.Popen` that :mod:`tests.launch` uses."""

    def __init__(self, pid: int, exit_file: Path, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exit_file = exit_file
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(FileNotFoundError):
                self.returncode = int(self._exit_file.read_text())
            if self.returncode is None and not self._server.alive():
                self.returncode = -signal.SIGKILL  # its server died, and took it along (PR_SET_PDEATHSIG)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """The test process's handle on the server (started by :func:`get`)."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        from tests.launch import die_with_parent

        self.errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 - the server's own output, closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver"],
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            start_new_session=True,
            preexec_fn=die_with_parent,
            text=True,
        )
        assert self.proc.stdout is not None
        self.ready = any(line.strip() == READY for line in self.proc.stdout)  # after what its imports print

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path, exit_file: Path) -> ForkedProcess:
        """Fork one rank running ``argv`` (``[script, *args]``) in ``env`` and ``cwd``, its output in ``log``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log), "exit": str(exit_file)}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        pid = self.proc.stdout.readline()
        if not pid:
            self.errors.seek(0)
            raise RuntimeError(f"the fork server stopped (exit {self.proc.wait()}):\n{self.errors.read()[-6000:]}")
        return ForkedProcess(int(pid), exit_file, self)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.errors.close()


_SERVER: list[ForkServer | None] = []  # the session's server, started on first use; [None] if it cannot fork


def get(env: dict[str, str], cwd: Path) -> ForkServer | None:
    """The session's fork server (started now with ``env`` if there is none, or if it died), or None where it cannot
    fork safely."""
    if _SERVER and _SERVER[0] is not None and not _SERVER[0].alive():
        _SERVER.pop()
    if not _SERVER:
        server = ForkServer(env, cwd)
        if not server.ready:
            server.stop()
        _SERVER.append(server if server.ready else None)
    return _SERVER[0]


def shutdown() -> None:
    while _SERVER:
        server = _SERVER.pop()
        if server is not None:
            server.stop()


# ----------------------------------------------------------------------------------------------
# the server's side
# ----------------------------------------------------------------------------------------------
def serve() -> dict[str, Any] | None:
    """Import :data:`PRELOAD`, then fork one child per job until stdin closes. Returns the job in a forked child
    (which goes on to become the rank), None in the server when it is done."""
    for module in PRELOAD:
        importlib.import_module(module)
    import torch

    if len(os.listdir("/proc/self/task")) > 1 or torch.cuda.is_initialized():
        print("not fork-safe", flush=True)
        return None
    gc.freeze()  # the imports' objects: no rank's collection walks them, nor copies their pages by marking them
    print(READY, flush=True)
    children: dict[int, str] = {}  # pid -> its exit file
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], POLL_S)
        _reap(children)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the test process is done with us
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job = json.loads(line)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                return job
            children[pid] = job["exit"]
            print(pid, flush=True)


def _reap(children: dict[int, str]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exit_file = Path(children.pop(pid))
        exit_file.with_suffix(".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
        exit_file.with_suffix(".tmp").replace(exit_file)


def become_rank(job: dict[str, Any], server_pid: int) -> None:
    """In the forked child: take the place of ``python argv...`` started by a launcher in ``env``."""
    from tests.launch import die_with_parent

    os.setsid()  # as Popen(start_new_session=True): killing the rank's group stops whatever it started
    die_with_parent()  # the server's death kills the rank
    if os.getppid() != server_pid:  # the server died before that
        os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(job["env"])
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for name, option in SET_AFTER_FORK.items():
        if name in os.environ:
            libc.mallopt(option, int(os.environ[name]))
    os.chdir(job["cwd"])
    sys.argv = list(job["argv"])
    import numpy
    import torch
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0  # read from the environment as Lightning's import does
    torch.seed()  # a fresh process's generators start from the OS's entropy (Python's random reseeds at fork)
    numpy.random.seed()


def run_rank() -> NoReturn:
    """Run the rank (:func:`tests.launch.main`) and exit as the interpreter would: an uncaught exception printed and
    exit code 1, ``SystemExit``'s code, an uncaught ``KeyboardInterrupt`` as death by SIGINT; non-daemon threads
    joined and exit handlers run. Then ``os._exit``: the interpreter's own teardown of the ~4000 modules the server
    imported takes ~1 s of CPU a rank and does nothing a test can see."""
    from tests.launch import main

    interrupted = False
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:  # noqa: BLE001 - what the interpreter does with any uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    server_pid = os.getpid()
    job = serve()
    if job is None:
        sys.exit(0)
    become_rank(job, server_pid)
    run_rank()
