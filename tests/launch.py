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
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

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
    launcher: Literal["env", "torchrun"] = "env",
    timeout: float = 600.0,
    extra_env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``target`` (``"module:function"``) on ``world_size`` processes; return each rank's result.

    ``launcher="env"`` starts every rank itself with the variables of a plain launcher (``RANK``, ``LOCAL_RANK``,
    ``NODE_RANK``, ...); ``"torchrun"`` starts one ``torchrun --node-rank i`` per node (``num_nodes`` launcher
    processes on loopback), which starts that node's ranks.
    """
    per_node = world_size // num_nodes
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        torch.save(args or {}, tmp_path / "args.pt")
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            **(extra_env or {}),
        }
        worker = ["-m", "tests.launch", target, str(tmp_path)]
        if launcher == "torchrun":
            names = [f"node {node} (torchrun)" for node in range(num_nodes)]
            commands = [
                ([sys.executable, "-m", "torch.distributed.run", f"--nnodes={num_nodes}", f"--node-rank={node}",
                  f"--nproc-per-node={per_node}", "--master-addr=127.0.0.1", f"--master-port={port}", *worker], env)
                for node in range(num_nodes)
            ]
        else:
            names = [f"rank {rank}" for rank in range(world_size)]
            commands = [
                ([sys.executable, *worker], {**env, "WORLD_SIZE": str(world_size), "RANK": str(rank),
                                             "LOCAL_RANK": str(rank % per_node), "NODE_RANK": str(rank // per_node)})
                for rank in range(world_size)
            ]
        procs, logs = [], []
        for index, (command, process_env) in enumerate(commands):
            log = open(tmp_path / f"process{index}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                command, env=process_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                start_new_session=True,  # one process group each: stopping a torchrun stops its ranks too
            ))
        failed = _wait_all(procs, timeout)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        if failed or os.environ.get("LAUNCH_VERBOSE"):
            report = "\n".join(
                f"----- {name} (exit {proc.returncode}) -----\n{out[-6000:]}" for name, proc, out in zip(names, procs, outputs)
            )
            raise AssertionError(f"{target} failed: {failed}\n{report}")
        return [torch.load(tmp_path / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            bad = [r for r, c in enumerate(codes) if c != 0]
            return f"ranks {bad} exited with an error" if bad else ""
        if any(c not in (None, 0) for c in codes):
            # one rank failed: give the others a moment to fail too, then stop them
            time.sleep(5)
            for p in procs:
                _kill_group(p)
            return "a rank exited with an error"
        time.sleep(0.1)
    for p in procs:
        _kill_group(p)
    return f"timed out after {timeout:.0f} s"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group has exited already
        pass


def _main() -> None:
    target, tmp = sys.argv[1], Path(sys.argv[2])
    module_name, function_name = target.split(":")
    worker = getattr(importlib.import_module(module_name), function_name)
    result = worker(torch.load(tmp / "args.pt", weights_only=False))
    torch.save(result, tmp / f"result{os.environ['RANK']}.pt")


if __name__ == "__main__":
    _main()
