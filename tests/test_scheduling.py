"""``--dist loadfile`` hands the longest test files out first, one to each worker, and the cheap ones last
(:mod:`tests.scheduling`), driven here through xdist's scheduler interface with stand-in workers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from xdist.scheduler import LoadFileScheduling

from tests.scheduling import EXPECTED_SECONDS, LongestFilesFirst


class Worker:
    """What the scheduler sees of a pytest-xdist worker: the indices it is sent, and its shutdown."""

    def __init__(self, name: str, sent: list[tuple[str, list[int]]]) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.pending: list[int] = []
        self._sent = sent

    def send_runtest_some(self, indices: list[int]) -> None:
        self._sent.append((self.gateway.id, indices))
        self.pending.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def hand_out(scheduling: type[LoadFileScheduling], tests_per_file: dict[str, int]) -> list[tuple[str, str]]:
    """Run the collection (files in alphabetical order, as pytest collects them) through ``scheduling`` with two
    workers that finish their tests in turn; return (worker, file) in the order the files were handed out."""
    collection = [f"tests/{file}::test_{i}" for file in sorted(tests_per_file) for i in range(tests_per_file[file])]
    config: Any = SimpleNamespace(getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=True))
    sent: list[tuple[str, list[int]]] = []
    scheduler = scheduling(config)
    workers = [Worker("gw0", sent), Worker("gw1", sent)]
    for worker in workers:
        scheduler.add_node(worker)  # type: ignore[arg-type]
        scheduler.add_node_collection(worker, collection)  # type: ignore[arg-type]
    scheduler.schedule()
    while any(worker.pending for worker in workers):
        for worker in workers:
            if worker.pending:
                scheduler.mark_test_complete(worker, worker.pending.pop(0))  # type: ignore[arg-type]
    return [(name, collection[indices[0]].split("::")[0].removeprefix("tests/")) for name, indices in sent]


def test_the_longest_files_start_first_on_different_workers_and_unlisted_files_still_run_last() -> None:
    tests_per_file = {
        "test_api.py": 11,  # cheap, not in the table
        "test_cli.py": 30,
        "test_gpu_side_by_side.py": 3,  # few tests, long ones
        "test_new.py": 40,  # a file the table does not know yet
        "test_vision.py": 60,
        "test_zoo.py": 1684,
    }
    assert all(file in EXPECTED_SECONDS for file in ["test_cli.py", "test_gpu_side_by_side.py", "test_zoo.py"])
    assert "test_new.py" not in EXPECTED_SECONDS and "test_api.py" not in EXPECTED_SECONDS

    order = hand_out(LongestFilesFirst, tests_per_file)

    assert order[:2] == [("gw0", "test_zoo.py"), ("gw1", "test_vision.py")]
    listed = ["test_zoo.py", "test_vision.py", "test_cli.py", "test_gpu_side_by_side.py"]
    assert [file for _, file in order] == [*listed, "test_new.py", "test_api.py"]  # then xdist's order: most tests

    # xdist's own order (by number of tests) leaves the 3-test file, long as it is, to the very end
    assert [file for _, file in hand_out(LoadFileScheduling, tests_per_file)][-1] == "test_gpu_side_by_side.py"
