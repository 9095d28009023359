"""The one multi-process test helper: run a function in N CPU processes joined by torch.distributed.

``launch("tests.test_x:worker", world_size=2, args={...})`` runs ``worker(args)`` on ``world_size`` Python processes
that have the environment of an external launcher (``MASTER_ADDR``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...; or
those of torchrun or srun), so Lightning joins them instead of spawning its own. The return values come back in rank
order. A failing or hanging rank fails the test with every rank's output, never a hang.

In the test session every rank (and every torchrun launcher) is forked from a warm process (:mod:`tests.forkserver`)
that has imported torch, Lightning, DeepSpeed, transformers and the package: a world starts in milliseconds instead
of ~8 s of CPU a rank, and every call still gets new processes. Ranks are started as fresh ``python -m tests.launch``
processes for ``extra_env`` read at process start (other than ``MALLOC_MMAP_THRESHOLD_``, which a forked rank sets
with ``mallopt``), outside the test session (benchmarks and scripts run as commands measure fresh processes) and
for every call with ``LAUNCH_FRESH=1``.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from tests import forkserver

REPO_ROOT = Path(__file__).resolve().parent.parent
Launcher = Literal["env", "torchrun", "slurm"]
# set by tests/conftest.py for the test session; benchmarks and scripts run as commands start fresh ranks
FORKED = False


PORTS_PER_WORKER = 400
# this test process's walk through its slice; other sessions on the machine start elsewhere in it
_port_offsets = itertools.count(os.getpid() % PORTS_PER_WORKER)


def free_port() -> int:
    """A port for a world's rendezvous that no other process is likely to take between this call and rank 0's bind.

    A port the kernel picks (``bind(("", 0))``) comes from its ephemeral range, from which every outgoing connection
    also takes its local port: the gloo connections of the other pytest-xdist worker's world (hundreds per world)
    could take it before rank 0 binds it ("address already in use"). This one lies below that range, in a slice of
    its own for each xdist worker, and binds now; successive calls walk the slice, so a world does not meet the
    previous world's port in TIME_WAIT.
    """
    low = _ephemeral_ports()[0]
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = low - PORTS_PER_WORKER * (worker + 1)
    if first < 1024:  # an ephemeral range that starts low leaves no room below it: the kernel's pick
        return _kernel_port()
    for _ in range(PORTS_PER_WORKER):
        port = first + next(_port_offsets) % PORTS_PER_WORKER
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken
                continue
        return port
    return _kernel_port()


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return int(low), int(high)


def _kernel_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """The test process as the one rank of a gloo world (an in-memory store): for code that asks the default process
    group its rank or world size, without starting processes."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def launch(
    target: str,
    world_size: int,
    args: dict[str, Any] | None = None,
    *,
    num_nodes: int = 1,
    launcher: Launcher = "env",
    timeout: float = 600.0,
    extra_env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``target`` (``"module:function"``) on ``world_size`` processes; return each rank's result.

    ``launcher="env"`` starts every rank itself with the variables of a plain launcher (``RANK``, ``LOCAL_RANK``,
    ``NODE_RANK``, ...); ``"torchrun"`` starts one ``torchrun --node-rank i`` per node (``num_nodes`` launcher
    processes on loopback), which starts that node's ranks; ``"slurm"`` starts every rank with the variables srun
    gives a task (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NTASKS``, ...) and no ``RANK`` or
    ``MASTER_ADDR``, as ``configs/slurm_2x8.sh`` runs them (it exports ``MASTER_PORT``).
    """
    with tempfile.TemporaryDirectory() as tmp:
        run = _run(target, world_size, args, Path(tmp), num_nodes, launcher, extra_env, timeout, grace=5.0)
        check_ranks(target, run.names, [proc.returncode for proc in run.procs], run.outputs, run.killed)
        return [torch.load(Path(tmp) / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


def check_ranks(
    target: str, names: list[str], returncodes: list[int | None], outputs: list[str], killed: list[str]
) -> None:
    """Fail with every rank's output if one failed (or always, with ``LAUNCH_VERBOSE=1``)."""
    bad = [name for name, code in zip(names, returncodes, strict=True) if code != 0]
    failed = f"{bad} failed ({killed} were stopped by the launcher)" if bad else ""
    if failed or os.environ.get("LAUNCH_VERBOSE"):
        report = "\n".join(
            f"----- {name} (exit {code}) -----\n{out[-6000:]}"
            for name, code, out in zip(names, returncodes, outputs, strict=True)
        )
        raise AssertionError(f"{target} failed: {failed}\n{report}")


def rank_environment(world_size: int, num_nodes: int, rank: int, port: int) -> dict[str, str]:
    """The environment a plain launcher gives ``rank`` (the test process's own, plus the rank's variables)."""
    per_node = world_size // num_nodes
    return {
        **_launcher_environment(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % per_node),
        "NODE_RANK": str(rank // per_node),
    }


def _launcher_environment(port: int) -> dict[str, str]:
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }


@dataclass
class RankExit:
    """How one rank ended: its exit code (None if it was still running at the timeout and was killed), its output,
    and what its function returned (None if it did not return)."""

    returncode: int | None
    output: str
    result: Any = None


def launch_to_exit(
    target: str, world_size: int, args: dict[str, Any] | None = None, *, timeout: float
) -> list[RankExit]:
    """Like :func:`launch`, but no rank is stopped because another failed: each must exit on its own within
    ``timeout`` seconds, or it is killed and reported with ``returncode=None``. For failure tests."""
    with tempfile.TemporaryDirectory() as tmp:
        run = _run(target, world_size, args, Path(tmp), 1, "env", None, timeout, grace=None)
        results = [Path(tmp) / f"result{rank}.pt" for rank in range(world_size)]
        return [
            RankExit(
                None if name in run.killed else proc.returncode,
                out,
                torch.load(result, weights_only=False) if result.is_file() else None,
            )
            for name, proc, out, result in zip(run.names, run.procs, run.outputs, results, strict=True)
        ]


@dataclass
class _Run:
    names: list[str]
    procs: list[subprocess.Popen]
    outputs: list[str]
    killed: list[str]


def _run(
    target: str,
    world_size: int,
    args: dict[str, Any] | None,
    tmp_path: Path,
    num_nodes: int,
    launcher: Launcher,
    extra_env: dict[str, str] | None,
    timeout: float,
    grace: float | None,
) -> _Run:
    per_node = world_size // num_nodes
    port = free_port()
    torch.save(args or {}, tmp_path / "args.pt")
    env = {**_launcher_environment(port), **(extra_env or {})}
    python = interpreter(extra_env)
    worker = ["-m", "tests.launch", target, str(tmp_path)]
    if launcher == "torchrun":
        names = [f"node {node} (torchrun)" for node in range(num_nodes)]
        commands = [
            (
                [
                    python,
                    "-m",
                    "torch.distributed.run",
                    f"--nnodes={num_nodes}",
                    f"--node-rank={node}",
                    f"--nproc-per-node={per_node}",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                    *worker,
                ],
                env,
            )
            for node in range(num_nodes)
        ]
    elif launcher == "slurm":
        names = [f"task {rank}" for rank in range(world_size)]
        srun = {
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "ulysses-test",
            "SLURM_NNODES": str(num_nodes),
            "SLURM_NTASKS": str(world_size),
            "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_CPUS_PER_TASK": "1",
        }
        task_env = {key: value for key, value in env.items() if key != "MASTER_ADDR"}  # SLURM_NODELIST names it
        commands = [
            (
                [python, *worker],
                {
                    **task_env,
                    **srun,
                    "SLURM_PROCID": str(rank),
                    "SLURM_LOCALID": str(rank % per_node),
                    "SLURM_NODEID": str(rank // per_node),
                },
            )
            for rank in range(world_size)
        ]
    else:
        names = [f"rank {rank}" for rank in range(world_size)]
        commands = [
            ([python, *worker], {**rank_environment(world_size, num_nodes, rank, port), **(extra_env or {})})
            for rank in range(world_size)
        ]
    logs = [tmp_path / f"process{index}.log" for index in range(len(commands))]
    procs = []
    for (command, process_env), log_path in zip(commands, logs, strict=True):
        with open(log_path, "w") as log:
            procs.append(
                subprocess.Popen(
                    command,
                    env=process_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO_ROOT,
                    start_new_session=True,  # one process group each: stopping a torchrun stops its ranks too
                    preexec_fn=die_with_parent,
                )
            )
    count_world_start("fresh" if python == sys.executable else "forked")
    try:
        killed = [names[i] for i in _wait_all(procs, timeout, grace)]
    except BaseException:  # pytest-timeout, ^C: no rank outlives the test that started it
        for proc in procs:
            kill_group(proc)
        raise
    outputs = [log.read_text(errors="replace") for log in logs]
    return _Run(names, procs, outputs, killed)


def interpreter(extra_env: dict[str, str] | None = None) -> str:
    """The ``python`` to start a process of the test session with: the fork server's (:mod:`tests.forkclient`), or
    the real one outside the session, with ``LAUNCH_FRESH=1``, or for ``extra_env`` that a process reads at start."""
    if not FORKED:
        return sys.executable
    server_env = _launcher_environment(port=0)
    if any(
        key not in forkserver.SET_AFTER_FORK and server_env.get(key) != value
        for key, value in (extra_env or {}).items()
    ):
        return sys.executable
    server = forkserver.get(server_env, REPO_ROOT)
    return sys.executable if server is None else server.python


WORLD_STARTS = {"fresh": 0, "forked": 0}


def count_world_start(kind: str = "fresh") -> None:
    """Counted for the session's summary (see ``tests/conftest.py``)."""
    WORLD_STARTS[kind] += 1


def die_with_parent() -> None:
    """Run in a child before it starts: the kernel kills it when the test process dies (killed by ``timeout``, an
    out-of-memory kill), which no ``finally`` of the test process would see."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def kill_group(proc: subprocess.Popen) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it started."""
    with contextlib.suppress(ProcessLookupError):  # the whole group has exited already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_all(procs: list[subprocess.Popen], timeout: float, grace: float | None) -> list[int]:
    """Wait for every process to exit; kill those left at ``timeout``, or ``grace`` seconds after one failed.
    Returns the indices of the killed processes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if grace is not None and any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)  # one failed: give the others a moment to fail too
        time.sleep(0.1)
    killed = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in killed:
        kill_group(procs[i])
    return killed


def resolve(target: str) -> Any:
    """The function ``target`` names, ``"module:function"``."""
    module_name, function_name = target.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def main() -> None:
    """A rank: ``python tests/launch.py module:function folder`` runs the function on ``folder/args.pt``."""
    target, tmp = sys.argv[1], Path(sys.argv[2])
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))  # srun's tasks have no RANK
    worker = resolve(target)
    result = worker(torch.load(tmp / "args.pt", weights_only=False))
    torch.save(result, tmp / f"result{rank}.pt")


if __name__ == "__main__":
    main()
