"""Pooled worlds for :func:`tests.launch.launch`: ``world_size`` persistent processes per size, started on first use
and kept for the session, each running one call after another.

A process world costs ~10 s of CPU per rank before the first line of a test runs (importing torch, Lightning,
DeepSpeed, transformers); the suite makes ~40 of them. A pooled rank pays it once.

Parent side (:func:`run_pooled`): each call gets a folder with its arguments and a fresh ``MASTER_PORT``; every
rank is sent one JSON line on its stdin (target, folder, the environment a fresh launch would give that rank)
and answers with ``status<rank>`` in the folder, after ``result<rank>.pt``. A rank that fails, dies or is late at
``timeout`` fails the call with every rank's output (as a fresh launch does) and the whole world is stopped: the
next call starts a new one, so an abandoned collective or a half-patched module never reaches another test.

Rank side (:func:`serve`): the call's output goes to ``process<rank>.log`` in its folder; before each call the
rank is put back in the state it had when it started (:class:`Baseline`).

Worn-out worlds: a call's gloo process groups can outlive it. ``destroy_process_group`` forgets them, but a
``ProcessGroupGloo`` frees its threads (two workers and a TCP loop that wakes ~100 times a second) only when the
object dies, and a finished fit's DeepSpeed engine, which holds its groups through Lightning's strategy, stays alive
in a cycle through its autograd hooks (C++, unseen by ``gc``; ``engine.destroy()`` removes them). A rank gained 30-100
threads per call of the training tests; 100 idle groups (300 threads) took 0.9 s of CPU per 10 s, mostly system
time. So a world that a call left with a rank over ``MAX_RANK_THREADS`` threads is stopped, and the next call starts
a new one.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.launch import (
    REPO_ROOT,
    check_ranks,
    count_world_start,
    die_with_parent,
    free_port,
    kill_group,
    rank_environment,
)

MAX_POOLED_PROCESSES = 6  # the least recently used world stops when a new one would exceed this (~0.5 GB a rank)
MAX_RANK_THREADS = 100  # a world stops after a call that left a rank with more (~0.3 ms of CPU a second each, idle)
FAILURE_GRACE_S = 5.0  # after one rank failed, the others may still fail on their own (their output is the report)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class _World:
    """The parent's handle on one pooled world."""

    def __init__(self, world_size: int, num_nodes: int) -> None:
        self.world_size = world_size
        # the ranks' output outside the calls (start-up, crashes), open as long as the world: closed by stop()
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.launch", "--serve"],
                env=rank_environment(world_size, num_nodes, rank, port=0),
                stdin=subprocess.PIPE,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                start_new_session=True,
                preexec_fn=die_with_parent,
                text=True,
            )
            for rank in range(world_size)
        ]
        count_world_start("pooled")

    def call(self, target: str, num_nodes: int, args: dict[str, Any] | None, timeout: float) -> list[Any]:
        """Run ``target`` on every rank; stops the world (then raises) if a rank fails, dies or is late."""
        count_world_start("pooled calls")
        names = [f"rank {rank} (pooled)" for rank in range(self.world_size)]
        with tempfile.TemporaryDirectory(prefix="launch-call-") as tmp:
            folder = Path(tmp)
            torch.save(args or {}, folder / "args.pt")
            port = free_port()
            for rank, proc in enumerate(self.procs):
                env = rank_environment(self.world_size, num_nodes, rank, port)
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"target": target, "folder": tmp, "env": env}) + "\n")
                proc.stdin.flush()
            try:
                statuses = self._wait(folder, timeout)
            except BaseException:  # pytest-timeout, ^C: the ranks are still in the call; no other call can use them
                self.stop()
                raise
            # a rank without a status died (its exit code) or is late (None: killed now)
            codes = [
                {"ok": 0, "failed": 1}.get(status, proc.poll())
                for status, proc in zip(statuses, self.procs, strict=True)
            ]
            killed = [name for name, code, status in zip(names, codes, statuses, strict=True) if code is None]
            died = any(code is not None and not status for code, status in zip(codes, statuses, strict=True))
            if any(code != 0 for code in codes):
                self.stop()
            outputs = [_read(folder / f"process{rank}.log") for rank in range(self.world_size)]
            if died:
                outputs = [out + _read_file(self.log) for out in outputs]  # its last words are here
            check_ranks(target, names, codes, outputs, killed)
            return [torch.load(folder / f"result{rank}.pt", weights_only=False) for rank in range(self.world_size)]

    def _wait(self, folder: Path, timeout: float) -> list[str]:
        """Each rank's status ("ok", "failed", or "" if it did not answer) once all answered, or one failed and the
        others had ``FAILURE_GRACE_S`` more, or at ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = [_read(folder / f"status{rank}") for rank in range(self.world_size)]
            if all(statuses) or time.monotonic() > deadline:
                return statuses
            if "failed" in statuses or any(proc.poll() is not None for proc in self.procs):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            time.sleep(0.05)

    def alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs)

    def worn_out(self) -> bool:
        """Whether a rank holds more than ``MAX_RANK_THREADS`` threads (see the module's docstring)."""
        return any(_thread_count(proc.pid) > MAX_RANK_THREADS for proc in self.procs)

    def stop(self) -> None:
        for proc in self.procs:
            kill_group(proc)
            if proc.stdin is not None:
                proc.stdin.close()
        self.log.close()


_WORLDS: dict[tuple[int, int], _World] = {}  # (world_size, num_nodes) -> world, least recently used first


def run_pooled(target: str, world_size: int, num_nodes: int, args: dict[str, Any] | None, timeout: float) -> list[Any]:
    """:func:`tests.launch.launch` on the pooled world of ``world_size`` ranks (started if there is none)."""
    key = (world_size, num_nodes)
    world = _WORLDS.pop(key, None)
    if world is not None and not world.alive():
        world.stop()
        world = None
    if world is None:
        while _WORLDS and sum(w.world_size for w in _WORLDS.values()) + world_size > MAX_POOLED_PROCESSES:
            _WORLDS.pop(next(iter(_WORLDS))).stop()
        world = _World(world_size, num_nodes)
    try:
        return world.call(target, num_nodes, args, timeout)
    finally:
        if world.alive() and world.worn_out():
            world.stop()
        elif world.alive():
            _WORLDS[key] = world


@atexit.register
def shutdown() -> None:
    """Stop every pooled world (also done by ``tests/conftest.py`` at the session's end)."""
    while _WORLDS:
        _WORLDS.popitem()[1].stop()


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:  # the process has exited
        return 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _read_file(log: Any) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-6000:]


# ----------------------------------------------------------------------------------------------
# the rank's side
# ----------------------------------------------------------------------------------------------
class Baseline:
    """What a call may change in a rank's process and a fresh process would not have, recorded at start-up and put
    back after every call: the environment and working directory (a call's own environment is set before it), the
    default process group and every subgroup, DeepSpeed's module-level groups and communication backend, torch's
    seed, default dtype, thread count, grad mode and determinism, dynamo's compiled code, logging levels and
    handlers, warning filters and signal handlers. What a successful call leaves patched on other modules is the
    package's to undo (its tests check that it does); a failed call stops the whole world."""

    def __init__(self) -> None:
        import deepspeed.comm.comm
        import deepspeed.runtime.zero.partition_parameters
        import deepspeed.utils.groups
        import lightning  # noqa: F401 - imported once, here, as every call needs it
        import transformers  # noqa: F401

        self.cwd = os.getcwd()
        self.rng_state = torch.get_rng_state()
        self.torch_state = (
            torch.get_default_dtype(),
            torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled(),
        )
        self.module_globals = {
            module: {
                name: value
                for name, value in vars(module).items()
                if not name.startswith("__") and (value is None or isinstance(value, dict) and not value)
            }
            for module in (deepspeed.utils.groups, deepspeed.comm.comm, deepspeed.runtime.zero.partition_parameters)
        }
        manager = logging.Logger.manager
        self.loggers = {
            name: (logger.level, list(logger.handlers), logger.propagate, logger.disabled)
            for name, logger in [("", logging.getLogger()), *manager.loggerDict.items()]
            if isinstance(logger, logging.Logger)
        }
        self.warning_filters = list(warnings.filters)
        self.signals = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def restore(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()  # the default group and every subgroup
        for module, values in self.module_globals.items():
            for name, value in values.items():
                setattr(module, name, {} if isinstance(value, dict) else value)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        torch.set_rng_state(self.rng_state)
        dtype, threads, deterministic = self.torch_state
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_grad_enabled(True)
        for name, (level, handlers, propagate, disabled) in self.loggers.items():
            logger = logging.getLogger(name or None)
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled
        for name, logger in logging.Logger.manager.loggerDict.items():
            if name not in self.loggers and isinstance(logger, logging.Logger):
                logger.handlers.clear()  # made by a call: its handlers may write to the call's closed log
        warnings.resetwarnings()
        warnings.filters[:] = self.warning_filters
        for sig, handler in self.signals.items():
            signal.signal(sig, handler)
        os.chdir(self.cwd)
        gc.collect()


def serve() -> None:
    """A pooled rank's loop: one call per line on stdin until it closes."""
    _exit_with_parent()
    baseline = Baseline()
    for line in sys.stdin:
        job = json.loads(line)
        folder = Path(job["folder"])
        rank = job["env"]["RANK"]
        ok = _call(job["target"], folder, job["env"], folder / f"process{rank}.log", baseline)
        (folder / f"status{rank}").write_text("ok" if ok else "failed")
        if not ok:
            os._exit(1)  # the parent stops this world (no exit handlers: they may wait on a broken process group)


def _call(target: str, folder: Path, env: dict[str, str], log_path: Path, baseline: Baseline) -> bool:
    """Run ``target`` as a fresh rank would (``env`` as its environment), its output in ``log_path``; then put the
    process back to ``baseline`` (a failure to do so fails the call)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            os.environ.clear()
            os.environ.update(env)
            module_name, function_name = target.split(":")
            worker = getattr(importlib.import_module(module_name), function_name)
            result = worker(torch.load(folder / "args.pt", weights_only=False))
            torch.save(result, folder / f"result{env['RANK']}.pt")
            baseline.restore()
            return True
        except BaseException:  # noqa: B036, BLE001 - whatever ends the call (SystemExit included) fails it, as a fresh rank
            traceback.print_exc()
            return False
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _exit_with_parent() -> None:
    """A rank whose test process died (killed, or stopped at a debugger's exit) must not outlive it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
