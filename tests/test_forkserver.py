"""The forked ranks of :func:`tests.launch.launch` (:mod:`tests.forkserver`): a forked rank starts from the state a
fresh ``python -m tests.launch`` process has and ends as one would; a failing, hanging or interrupted call fails with
every rank's output and leaves no rank behind."""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

import tests.launch
from tests import forkserver
from tests.launch import launch, launch_to_exit

pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def _forked(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the fork server: on, also in a session run with ``LAUNCH_FRESH=1``."""
    monkeypatch.setattr(tests.launch, "FORKED", True)


def state_worker(args: dict[str, Any]) -> dict[str, Any]:
    """What a rank could inherit from the process it was forked from, after the imports the fork server makes."""
    for module in forkserver.PRELOAD:
        importlib.import_module(module)
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "session_leader": os.getsid(0) == os.getpid(),
        "cwd": os.getcwd(),
        "left_behind": os.environ.get("LEFT_BEHIND"),
        "rank": os.environ["RANK"],
        "rank_zero_only": rank_zero_only.rank,
        "argv": sys.argv[1:],
        "seed": torch.initial_seed(),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "process_group": dist.is_initialized(),
        "lightning_level": logging.getLogger("lightning").level,
        "warning_filters": len(warnings.filters),
    }


def dirty_worker(args: dict[str, Any]) -> int:
    """Leaves behind what a careless call could: environment, directory, seed, dtype, process group, log level."""
    os.environ["LEFT_BEHIND"] = "1"
    os.chdir("/")
    torch.manual_seed(123)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.new_group(ranks=[0, 1])
    logging.getLogger("lightning").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    return os.getpid()


def failing_worker(args: dict[str, Any]) -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails on purpose")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.barrier()  # rank 0 waits for rank 1, which never comes


def sleeping_worker(args: dict[str, Any]) -> None:
    if os.environ["RANK"] == "1":
        time.sleep(600)


def hanging_worker(args: dict[str, Any]) -> None:
    time.sleep(600)


def ending_worker(args: dict[str, Any]) -> None:
    """Ends the way ``args["end"]`` says, after registering an exit handler that prints."""
    atexit.register(print, "exit handler ran", flush=True)
    end = args["end"]
    if end == "exit 3":
        sys.exit(3)
    if end == "exit message":
        sys.exit("stopped with a message")
    if end == "error":
        raise ValueError("an uncaught error")
    if end == "interrupt":
        raise KeyboardInterrupt


def waiting_worker(args: dict[str, Any]) -> None:
    """Says who it is and where it runs in ``args["ready"]`` (written whole, then renamed: the test never reads it
    half-written, and signals only once the writing is done), then waits to be signalled."""
    state = {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "executable": sys.executable,
        "rank_zero_only": state_worker({})["rank_zero_only"],
    }
    written = args["ready"].with_suffix(".partial")
    torch.save(state, written)
    os.replace(written, args["ready"])
    time.sleep(120)


def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tests.launch, "FORKED", False)


def test_a_forked_rank_starts_from_the_state_of_a_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    dirty = launch("tests.test_forkserver:dirty_worker", 2)
    forked = launch("tests.test_forkserver:state_worker", 2)
    server = forkserver.get(tests.launch._launcher_environment(port=0), tests.launch.REPO_ROOT)
    assert server is not None
    assert {result["parent"] for result in forked} == {server.proc.pid}, "not forked from the session's server"
    assert not {result["pid"] for result in forked} & set(dirty)
    _fresh(monkeypatch)
    fresh = launch("tests.test_forkserver:state_worker", 2)
    assert {result["parent"] for result in fresh} == {os.getpid()}
    assert len({result["seed"] for result in forked + fresh}) == 4, "each rank's generator starts from its own seed"
    for rank, (got, want) in enumerate(zip(forked, fresh, strict=True)):
        assert got["rank_zero_only"] == rank
        assert got["argv"][0] == "tests.test_forkserver:state_worker"
        same = {key: value for key, value in got.items() if key not in ("pid", "parent", "argv", "seed")}
        assert same == {key: want[key] for key in same}


@pytest.mark.parametrize(
    ("end", "returncode", "says"),
    [
        ("return", 0, None),
        ("exit 3", 3, None),
        ("exit message", 1, "stopped with a message"),
        ("error", 1, "ValueError: an uncaught error"),
        ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ],
)
def test_a_forked_rank_ends_as_a_fresh_process_does(end: str, returncode: int, says: str | None) -> None:
    """As the interpreter ends a fresh ``python tests/launch.py``: exit handlers run, an uncaught exception is printed
    and exits 1, ``sys.exit``'s code or message, an uncaught ``KeyboardInterrupt`` as death by SIGINT."""
    exit = launch_to_exit("tests.test_forkserver:ending_worker", 1, {"end": end}, timeout=120)[0]
    assert exit.returncode == returncode, f"exit {exit.returncode}\n{exit.output}"
    assert "exit handler ran" in exit.output, exit.output
    assert says is None or says in exit.output, exit.output


def test_ranks_with_malloc_options_are_forked_and_others_are_fresh() -> None:
    malloc = launch("tests.test_forkserver:state_worker", 1, extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert malloc[0]["parent"] != os.getpid()
    other = launch("tests.test_forkserver:state_worker", 1, extra_env={"MALLOC_ARENA_MAX": "2"})
    assert other[0]["parent"] == os.getpid()


def test_a_failing_call_fails_with_every_rank_output() -> None:
    with pytest.raises(AssertionError, match=r"(?s)'rank 1'\] failed.*rank 1 fails on purpose"):
        launch("tests.test_forkserver:failing_worker", 2)


def test_a_hanging_call_is_stopped_at_its_timeout() -> None:
    """Every rank hangs, so each is still running at the timeout however slowly the machine starts them (a rank
    that had to finish first would race the timeout)."""
    stopped = r"\['rank 0', 'rank 1'\]"
    with pytest.raises(AssertionError, match=rf"{stopped} failed \({stopped} were stopped"):
        launch("tests.test_forkserver:hanging_worker", 2, timeout=6)


class _Interrupted(Exception):
    """What pytest-timeout raises in the test's thread."""


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_a_call_interrupted_from_outside_stops_its_ranks(monkeypatch: pytest.MonkeyPatch, forked: bool) -> None:
    monkeypatch.setattr(tests.launch, "FORKED", forked)
    # the fork server first (seconds of imports where this test runs alone): the alarm must interrupt the ranks,
    # not the server's start, which would leave it running unregistered, where it reads as a rank left behind
    tests.launch.interpreter()
    running = _rank_processes()

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(3)
    try:
        with pytest.raises(_Interrupted):
            launch("tests.test_forkserver:sleeping_worker", 2, timeout=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    # a forked rank dies when the fork server sees its client killed: moments later, not before launch returns
    deadline = time.monotonic() + 5
    while (left := _rank_processes() - running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"ranks of the interrupted call still run: {left}"


def _session_python() -> str:
    python = tests.launch.interpreter()
    assert python != sys.executable, "the session has no fork server"
    return python


def test_the_session_python_runs_other_commands_in_the_real_interpreter() -> None:
    python = _session_python()
    result = subprocess.run(
        [python, "-c", "import os, sys; print(sys.executable, os.getppid())"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [sys.executable, str(os.getpid())]  # exec'd: its own pid
    assert subprocess.run([python, "-c", "raise SystemExit(7)"]).returncode == 7


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_session_python_reaches_the_forked_process(tmp_path: Path, signum: int) -> None:
    """As a terminal's Ctrl-C or a launcher's SIGTERM reaches a fresh ``python -m tests.launch``: the forked process
    gets it, and the client ends as the forked process did."""
    if signal.getsignal(signum) == signal.SIG_IGN:
        # e.g. a suite started as `pytest &` by a shell without job control, which ignores SIGINT and SIGQUIT in its
        # background jobs: every process the session starts inherits that, a fresh python as much as a forked one
        pytest.skip(f"{signal.Signals(signum).name} is ignored in this test session and in every process it starts")
    python = _session_python()
    torch.save({"ready": tmp_path / "ready.pt"}, tmp_path / "args.pt")
    client = subprocess.Popen(
        [python, "-m", "tests.launch", "tests.test_forkserver:waiting_worker", str(tmp_path)],
        env={**tests.launch.rank_environment(1, 1, 0, port=0)},
        cwd=tests.launch.REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready.pt").is_file() and client.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        state = torch.load(tmp_path / "ready.pt")
        servers = {server.proc.pid for server in forkserver._SERVER if server is not None}
        assert state["parent"] in servers, "not forked from the session's server"
        assert state["executable"] == python and state["rank_zero_only"] == 0
        client.send_signal(signum)
        try:
            output = client.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"no end 60 s after the signal: {_process_states({'client': client.pid, 'forked': state['pid']})}"
            )
    finally:
        client.kill()
    if signum == signal.SIGINT:  # an uncaught KeyboardInterrupt
        assert client.returncode == -signal.SIGINT and "KeyboardInterrupt" in output, output
    else:
        assert client.returncode == -signal.SIGTERM, output


def _process_states(pids: dict[str, int]) -> str:
    """Each process's state, pending, blocked and ignored signals, and kernel wait channel (``/proc``)."""
    states = []
    for name, pid in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            fields = [line for line in status if line.startswith(("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn"))]
            states.append(f"{name} {pid}: {'; '.join(fields)}; wchan {Path(f'/proc/{pid}/wchan').read_text()}")
        except OSError as error:
            states.append(f"{name} {pid}: {error}")
    return " | ".join(states)


def _rank_processes() -> set[int]:
    """This test process's live ranks, forked or fresh (not the fork server, not other sessions' processes)."""
    servers = {server.proc.pid for server in forkserver._SERVER if server is not None}
    ranks = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            command = " ".join(proc.cmdline())
            running = proc.status() != psutil.STATUS_ZOMBIE
            if ("tests.launch" in command or "tests.forkserver" in command) and running and proc.pid not in servers:
                ranks.add(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return ranks
