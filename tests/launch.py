"""The one multi-process test helper: run a function in N CPU processes joined by torch.distributed.

``launch("tests.test_x:worker", world_size=2, args={...})`` starts ``world_size`` Python processes
(``python -m tests.launch``) with the environment of an external launcher (``MASTER_ADDR``,
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), so Lightning joins them instead of spawning its own.
Each calls ``worker(args)``; the return values come back in rank order. A failing or hanging rank
fails the test with every rank's output, never a hang.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    target: str,
    world_size: int,
    args: dict[str, Any] | None = None,
    *,
    num_nodes: int = 1,
    timeout: float = 600.0,
    extra_env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``target`` (``"module:function"``) on ``world_size`` processes; return each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        procs, outputs, killed = _run(target, world_size, args, Path(tmp), num_nodes, extra_env, timeout, grace=5.0)
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        failed = f"ranks {bad} failed (ranks {killed} were stopped by the launcher)" if bad else ""
        if failed or os.environ.get("LAUNCH_VERBOSE"):
            report = "\n".join(f"----- rank {r} (exit {procs[r].returncode}) -----\n{out[-6000:]}" for r, out in enumerate(outputs))
            raise AssertionError(f"{target} failed: {failed}\n{report}")
        return [torch.load(Path(tmp) / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


@dataclass
class RankExit:
    """How one rank ended: its exit code (None if it was still running at the timeout and was killed)."""

    returncode: int | None
    output: str


def launch_to_exit(target: str, world_size: int, args: dict[str, Any] | None = None, *, timeout: float) -> list[RankExit]:
    """Like :func:`launch`, but no rank is stopped because another failed: each must exit on its own within
    ``timeout`` seconds, or it is killed and reported with ``returncode=None``. For failure tests."""
    with tempfile.TemporaryDirectory() as tmp:
        procs, outputs, killed = _run(target, world_size, args, Path(tmp), 1, None, timeout, grace=None)
        return [RankExit(None if r in killed else p.returncode, out) for r, (p, out) in enumerate(zip(procs, outputs))]


def _run(
    target: str, world_size: int, args: dict[str, Any] | None, tmp_path: Path, num_nodes: int,
    extra_env: dict[str, str] | None, timeout: float, grace: float | None,
) -> tuple[list[subprocess.Popen], list[str], list[int]]:
    per_node = world_size // num_nodes
    port = free_port()
    torch.save(args or {}, tmp_path / "args.pt")
    procs, logs = [], []
    for rank in range(world_size):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % per_node),
            "NODE_RANK": str(rank // per_node),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            **(extra_env or {}),
        }
        log = open(tmp_path / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.launch", target, str(tmp_path)],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            )
        )
    killed = _wait_all(procs, timeout, grace)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return procs, outputs, killed


def _wait_all(procs: list[subprocess.Popen], timeout: float, grace: float | None) -> list[int]:
    """Wait for every process to exit; kill those left at ``timeout``, or ``grace`` seconds after one failed.
    Returns the killed ranks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if grace is not None and any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)  # one rank failed: give the others a moment to fail too
        time.sleep(0.1)
    killed = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in killed:
        procs[r].kill()
        procs[r].wait()
    return killed


def _main() -> None:
    target, tmp = sys.argv[1], Path(sys.argv[2])
    module_name, function_name = target.split(":")
    worker = getattr(importlib.import_module(module_name), function_name)
    result = worker(torch.load(tmp / "args.pt", weights_only=False))
    torch.save(result, tmp / f"result{os.environ['RANK']}.pt")


if __name__ == "__main__":
    _main()
