"""Case tables: named cases that one process world runs one after another, each then checked by its own test.

The multi-process tests compare many configurations (stages, SP and DP sizes, models, data) with one process of the
plain model. A world per case would spend its time starting; a table runs all its cases in one launch::

    TWO_RANKS = CaseTable("two_rank_results", "tests.test_x:fit_case", world_size=2, cases={
        "sp2_zero2": dict(sp=2, stage=2),
        "sp2_zero3": dict(sp=2, stage=3),
    })
    two_rank_results = TWO_RANKS.fixture()  # module scope: one launch, the first time a test asks for it

    @TWO_RANKS.each_case
    def test_two_ranks_equal_one_process(two_rank_results, name):
        check(two_rank_results, name, TWO_RANKS.cases[name])

Every rank calls ``fit_case(name, case, world_size, **shared)`` for each case in order and returns ``{name:
result}``; the fixture's value is that dict of every rank, in rank order. ``shared`` comes from the fixture's
``prepare(cases, folder)`` (data or initial weights written once for the whole table into a temporary folder).
``also`` names more functions the same world runs after the cases, ``function(world_size)``, each result under its
own key.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.launch import launch, resolve

Test = TypeVar("Test", bound=Callable[..., Any])
Prepare = Callable[[Mapping[str, dict[str, Any]], Path], dict[str, Any]]


@dataclass(frozen=True)
class CaseTable:
    fixture_name: str
    fit_case: str  # "module:function", called on every rank as fit_case(name, case, world_size, **shared)
    world_size: int
    cases: Mapping[str, dict[str, Any]]
    also: Mapping[str, str] = field(default_factory=dict)  # key -> "module:function", called as function(world_size)

    def run(self, shared: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Every case on one world: each rank's ``{name: result}``, in rank order."""
        args = {"fit_case": self.fit_case, "cases": dict(self.cases), "shared": shared or {}, "also": dict(self.also)}
        return launch("tests.cases:run_table", self.world_size, args)

    def fixture(self, prepare: Prepare | None = None) -> Any:
        """A module-scoped fixture named ``fixture_name`` whose value is :meth:`run`'s, with the shared arguments
        ``prepare(cases, folder)`` returns (``folder``: a new temporary folder of the test session)."""

        def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
            if prepare is None:
                return self.run()
            return self.run(prepare(self.cases, tmp_path_factory.mktemp(self.fixture_name)))

        return pytest.fixture(scope="module", name=self.fixture_name)(results)

    def each_case(self, test: Test) -> Test:
        """Parametrize ``test`` with ``name``, one per case."""
        return pytest.mark.parametrize("name", list(self.cases))(test)


def run_table(args: dict[str, Any]) -> dict[str, Any]:
    """A rank's side of :meth:`CaseTable.run`."""
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown deletes it
    fit_case = resolve(args["fit_case"])
    results = {name: fit_case(name, case, world_size, **args["shared"]) for name, case in args["cases"].items()}
    return {**results, **{key: resolve(target)(world_size) for key, target in args["also"].items()}}
