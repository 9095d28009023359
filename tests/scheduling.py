"""The order in which ``pytest -n auto --dist loadfile`` (``scripts/check.sh``) hands test files to its workers: the
longest first, so that the last files to finish are short ones and no worker idles while another runs a long file.

pytest-xdist's ``loadfile`` hands out one file at a time, whenever a worker has two tests or fewer left, in the order
of its queue: by number of tests (``--loadscope-reorder``, its default), which puts files of few but long tests
(``test_gpu_side_by_side.py``: 3 tests, 47 s) at the end, where they run while the other worker has nothing left.
:class:`LongestFilesFirst` hands out the file of the largest :data:`EXPECTED_SECONDS` instead (longest processing
time first), falling back to xdist's order for the files the table leaves out (cheap ones: they go last). A file
missing from the table still runs; the table only orders.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

# Seconds each file takes in the suite on 2 cores (setup, call and teardown of its tests; measured at c17c954 with
# `--durations=0`; test_cli, test_configs and test_gpu_side_by_side scaled by what this branch cut from them: 0.42, 0.76
# and 0.32, timed side by side): every file over ~10 s. Only the order matters; remeasure when a file's cost changes
# by a lot.
EXPECTED_SECONDS = {
    "test_zoo.py": 520,  # test_zoo_options.py's 452 s and its own 195, less the default runs made once (~120 s)
    "test_vision.py": 70,
    "test_hybrid.py": 57,
    "test_configs.py": 48,
    "test_failures.py": 44,
    "test_cli.py": 43,
    "test_benchmarks.py": 36,
    "test_forkserver.py": 32,
    "test_memory.py": 28,
    "test_finetune.py": 19,
    "test_attention_training.py": 16,
    "test_gpu_side_by_side.py": 15,
    "test_emulate.py": 15,
    "test_zoo_configs.py": 13,
    "test_attention.py": 12,
    "test_process_state.py": 11,
    "test_sp_loaders.py": 11,
    "test_equivalence.py": 11,
    "test_checkpoint.py": 11,
    "test_flex_memory.py": 10,
}


def expected_seconds(file: str) -> float:
    """The table's seconds for a file (a ``loadfile`` scope, ``tests/test_x.py``); 0 for a file it leaves out."""
    return EXPECTED_SECONDS.get(PurePosixPath(file).name, 0)


class LongestFilesFirst(LoadFileScheduling):
    """``--dist loadfile`` that hands each worker the longest file still waiting (by :func:`expected_seconds`; ties
    in xdist's own order)."""

    def _assign_work_unit(self, node: WorkerController) -> None:
        longest = max(self.workqueue, key=expected_seconds)  # max keeps the first of equals
        self.workqueue.move_to_end(longest, last=False)
        super()._assign_work_unit(node)
