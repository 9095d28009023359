"""A fork server for the test session: one process that has imported torch, Lightning, DeepSpeed, transformers and
the package, and forks from that state every process that the session starts as ``python -m`` of a module in
:data:`tests.forkclient.FORKABLE`: the ranks of :func:`tests.launch.launch`'s worlds, torchrun and its workers, the
CLI and the ranks its Lightning launcher starts.

A process started with ``python -m tests.launch`` spends ~8 s of CPU importing before the first line of its test
runs; a forked one starts in milliseconds, with the memory of those imports shared copy-on-write. Every start still
gets a new process: nothing one test does reaches another, and a test may kill, signal or fail it as a fresh one.
It is started as the interpreter: the server's ``python`` (:mod:`tests.forkclient`, a client that stands in for the
process, its pid and exit code those of a ``python`` process) asks the server to fork; the forked process takes the
client's environment, working directory, arguments and standard streams, leads its own session (process group),
runs the module as ``python -m`` does, and exits through the interpreter's normal shutdown (exit handlers, an
uncaught ``KeyboardInterrupt`` as SIGINT). Its ``sys.executable`` is the server's ``python`` again.

What a fresh process reads from its environment while importing is read again after the fork where it differs
between ranks (Lightning's ``rank_zero_only.rank``); what is read at process start (``MALLOC_*``) cannot be, so
:func:`tests.launch.launch` starts those with ``extra_env`` as fresh processes.

The server forks only while it is fork-safe: one thread and no CUDA context. Where its imports leave more (a build
whose import starts threads), it says so and exits, and processes are started fresh.

Protocol (a Unix ``SOCK_SEQPACKET`` socket, one message each way per step): the client sends
``{"argv", "env", "cwd"}`` as JSON with its stdin, stdout and stderr (``SCM_RIGHTS``); the server answers with the
forked pid once it leads its own group, and later with its exit code (``-N`` for signal N, as
``Popen.returncode``). The test process closes the server's stdin to stop it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import runpy
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
SOCKET, PYTHON = "socket", "python"  # in the server's folder
POLL_S = 0.02


class ForkServer:
    """The test process's handle on the server (started by :func:`get`); :attr:`python` is its stand-in for the
    interpreter (:mod:`tests.forkclient`)."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        from tests.launch import die_with_parent

        self.folder = tempfile.TemporaryDirectory(prefix="forkserver-")  # its socket and its ``python``
        self.python = str(Path(self.folder.name) / PYTHON)
        self.errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 - the server's own output, closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", self.folder.name],
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
        self.ready = any(line.strip() == READY for line in self.proc.stdout) and self._runs()

    def _runs(self) -> bool:
        """Whether its ``python`` starts (a temporary folder mounted ``noexec`` would refuse it)."""
        try:
            return subprocess.run([self.python, "-c", ""], timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.errors.close()
        self.folder.cleanup()


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
def serve(folder: Path) -> tuple[dict[str, Any], list[int]] | None:
    """Import :data:`PRELOAD`, write the ``python`` of :mod:`tests.forkclient` into ``folder`` and fork one process
    per client until stdin closes. Returns ``(job, its standard streams)`` in a forked process (which goes on to
    become what the job asks for), None in the server when it is done."""
    for module in PRELOAD:
        importlib.import_module(module)
    import torch

    if len(os.listdir("/proc/self/task")) > 1 or torch.cuda.is_initialized():
        print("not fork-safe", flush=True)
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(folder / SOCKET))
    listener.listen(64)
    client = Path(__file__).with_name("forkclient.py")
    python = folder / PYTHON
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S {client} {folder / SOCKET} "$@"\n')
    python.chmod(0o755)
    gc.freeze()  # the imports' objects: no rank's collection walks them, nor copies their pages by marking them
    print(READY, flush=True)
    waiting: set[socket.socket] = set()  # connected clients that have not sent their job yet
    running: dict[int, socket.socket] = {}  # forked pid -> its client
    while True:
        readable, _, _ = select.select([0, listener, *waiting, *running.values()], [], [], POLL_S)
        for source in readable:
            if source == 0:
                if not os.read(0, 1 << 16):  # the test process is done with us
                    return None
            elif source is listener:
                waiting.add(listener.accept()[0])
            elif source in waiting:
                waiting.remove(source)
                message, fds, _, _ = socket.recv_fds(source, 1 << 20, 3)
                if not message:
                    source.close()
                    continue
                sync_read, sync_write = os.pipe()
                pid = os.fork()
                if pid == 0:
                    for other in [listener, *waiting, *running.values(), source]:
                        other.close()
                    os.close(sync_read)
                    os.setsid()  # as Popen(start_new_session=True): its client signals its group
                    os.close(sync_write)
                    return json.loads(message), fds
                os.close(sync_write)
                os.read(sync_read, 1)  # its own group exists: the client may signal it
                os.close(sync_read)
                for fd in fds:
                    os.close(fd)
                running[pid] = source
                source.send(str(pid).encode())
            elif not source.recv(64):  # its client died (killed): so does what it stood for
                pid = next(pid for pid, client in running.items() if client is source)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        _reap(running)  # after the loop: it closes the clients it answers


def _reap(running: dict[int, socket.socket]) -> None:
    """Tell the clients of exited processes how they ended (as ``Popen.returncode``: ``-N`` for signal N)."""
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        client = running.pop(pid)
        with contextlib.suppress(OSError):  # a killed client
            client.send(str(os.waitstatus_to_exitcode(status)).encode())
        client.close()


def become(job: dict[str, Any], streams: list[int], server_pid: int, python: str) -> None:
    """In the forked process: take the place of ``python argv...`` started in ``env`` and ``cwd`` with ``streams``
    as its stdin, stdout and stderr."""
    from tests.launch import die_with_parent

    die_with_parent()  # the server's death kills it
    if os.getppid() != server_pid:  # the server died before that
        os._exit(1)
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for name, option in SET_AFTER_FORK.items():
        if name in os.environ:
            libc.mallopt(option, int(os.environ[name]))
    os.chdir(job["cwd"])
    sys.path[0] = job["cwd"]  # ``python -m`` puts the working directory first
    sys.executable = python  # what it starts with ``sys.executable`` is forked too
    if "-u" in job["argv"][: job["argv"].index("-m")]:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    import numpy
    import torch
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0  # read from the environment as Lightning's import does
    torch.seed()  # a fresh process's generators start from the OS's entropy (Python's random reseeds at fork)
    numpy.random.seed()


def run(argv: list[str]) -> NoReturn:
    """Run ``python argv...`` (``[options..., "-m", module, args...]``) as ``python -m`` does, and exit as the
    interpreter would: an uncaught exception printed and exit code 1, ``SystemExit``'s code, an uncaught
    ``KeyboardInterrupt`` as death by SIGINT; non-daemon threads joined and exit handlers run. Then ``os._exit``: the
    interpreter's own teardown of the ~4000 modules the server imported takes ~1 s of CPU a process and does nothing
    a test can see."""
    module = argv.index("-m") + 1
    sys.argv = ["-m", *argv[module + 1 :]]  # runpy puts the module's file first, as ``python -m`` does
    sys.modules.pop(argv[module], None)  # a fresh ``python -m`` runs it as ``__main__`` only: import it again
    interrupted = False
    try:
        runpy._run_module_as_main(argv[module])  # type: ignore[attr-defined]
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
    server_pid, folder = os.getpid(), Path(sys.argv[1])
    forked = serve(folder)
    if forked is None:
        sys.exit(0)
    job, streams = forked
    become(job, streams, server_pid, str(folder / PYTHON))
    run(job["argv"])
