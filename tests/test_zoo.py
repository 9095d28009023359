"""The model zoo (see :mod:`tests.zoo`): every causal LM that transformers registers trains exactly like one
process on the whole sequence under ``UlyssesStrategy(sp_size=2)``, or is refused at set-up; and trains so from a
``save_pretrained`` folder with every memory option on, or is refused at set-up naming the option to drop.

Also crossed with each memory option alone: ``tiled_loss``, ``tiled_mlp``, ``fused_norms``, ``head_chunks="auto"``,
activation checkpointing with offload, and none ("pretrained"), each from the ``save_pretrained`` folder loaded with
``from_pretrained`` (eval mode, as users get it), against one process of the plain model loaded from the same folder
in train mode.

One test per entry and setting, all from one 2-process launch (the default set-up, every single option and all of
them together: the references and the default runs are made once for all the settings); the table of every entry is
printed once. The families whose token mixers run head-sharded (:mod:`lightning_ulysses.hf.mixers`) run again at
sp=4, from one 4-process launch. An entry fails when its verdict is FAIL (ran and differs), ERROR (an exception other
than the set-up refusal) or NOT BUILT (the harness could not build the tiny model or run the plain one: a harness bug
to fix), and is skipped when building it needs an optional package that is not installed. With an option on it fails
unless it PASSes (exact, and activation checkpointing and the tiled loss show their effect) or is REFUSED by a message
that names an option asked for. The control tests check that the harness can fail: families known to match pass, and
the same model with a wrong SP loss fails, in the default set-up and under each setting. The harness's own pieces are
tested in ``tests/test_zoo_harness.py``.
"""

from __future__ import annotations

import pytest

from tests.zoo import (
    CONTROL_ENTRIES,
    FAIL,
    GATHER,
    NOT_BUILT,
    OPTION_SETTINGS,
    PASS,
    REFUSED,
    SHARDED_MIXER_FAMILIES,
    SINGLE_OPTION_SETTINGS,
    Outcome,
    format_table,
    option_run_problem,
    run_zoo,
    zoo_entries,
)

pytestmark = [pytest.mark.distributed, pytest.mark.zoo]

ENTRIES = [entry.name for entry in zoo_entries() if entry not in CONTROL_ENTRIES]
KNOWN_TO_MATCH = ["llama", "mistral", "qwen3"]
EVERY_OPTION = "all options"


@pytest.fixture(scope="module")
def zoo(request: pytest.FixtureRequest) -> dict[str, Outcome]:
    results = run_zoo(settings=list(OPTION_SETTINGS))
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print("\n" + format_table(results))  # shown also when pytest captures output
    return results


@pytest.fixture(scope="module")
def zoo_sp4() -> dict[str, Outcome]:
    """The families whose token mixers run head-sharded, at sp=4 (4 processes, one SP group)."""
    results = run_zoo([entry for entry in zoo_entries() if entry.name in SHARDED_MIXER_FAMILIES], sp_size=4)
    return results


@pytest.mark.parametrize("name", ENTRIES)
def test_family_trains_exactly_or_is_refused(zoo: dict[str, Outcome], name: str) -> None:
    outcome = zoo[name]
    if outcome.missing_package:
        pytest.skip(f"{name} needs a package that is not installed: {outcome.reason}")
    assert outcome.verdict in (PASS, GATHER, REFUSED), (
        f"{name} [{outcome.features}]: {outcome.verdict} (loss error {outcome.loss_error}, "
        f"update error {outcome.update_error}) {outcome.reason}"
    )


@pytest.mark.parametrize("name", ENTRIES)
def test_family_trains_from_pretrained_with_every_option_or_refuses_one(zoo: dict[str, Outcome], name: str) -> None:
    outcome = zoo[name]
    if outcome.verdict in (REFUSED, NOT_BUILT):
        pytest.skip(f"{name} does not train in the default set-up ({outcome.verdict}): no option runs")
    problem = option_run_problem(outcome, EVERY_OPTION)
    assert not problem, f"{name} [{outcome.features}] {problem}"


@pytest.mark.parametrize("setting", SINGLE_OPTION_SETTINGS)
@pytest.mark.parametrize("name", ENTRIES)
def test_family_trains_from_pretrained_with_the_option_or_refuses_it(
    zoo: dict[str, Outcome], name: str, setting: str
) -> None:
    outcome = zoo[name]
    if outcome.verdict in (REFUSED, NOT_BUILT):
        pytest.skip(f"{name} does not train in the default set-up ({outcome.verdict}): no option runs")
    problem = option_run_problem(outcome, setting)
    assert not problem, f"{name} [{outcome.features}] {problem}"


@pytest.mark.parametrize("name", KNOWN_TO_MATCH)
def test_families_known_to_match_pass(zoo: dict[str, Outcome], name: str) -> None:
    assert zoo[name].verdict == PASS, zoo[name]


def test_wrong_sp_loss_fails(zoo: dict[str, Outcome]) -> None:
    """The control entry doubles the SP loss: the harness must see a loss and an update off by a factor of 2, in the
    default set-up and from the pretrained folder under every setting (each option alone, all of them together)."""
    for entry in CONTROL_ENTRIES:
        outcome = zoo[entry.name]
        for run in (outcome, *(outcome.options[setting] for setting in OPTION_SETTINGS)):
            assert run.verdict == FAIL, run
            assert run.loss_error == pytest.approx(1.0, rel=1e-3)
            assert run.update_error == pytest.approx(1.0, rel=1e-3)


def test_sharded_mixer_families_are_listed(zoo: dict[str, Outcome]) -> None:
    """The families that the sp=4 run covers are exactly those whose SP run at sp=2 sharded token mixers (in any of
    their entries: the variants of a family shard as it does)."""
    sharded = [entry for entry in zoo_entries() if zoo[entry.name].sharded_mixers and entry not in CONTROL_ENTRIES]
    assert {entry.model_type for entry in sharded} == set(SHARDED_MIXER_FAMILIES)
    assert all(zoo[entry.name].verdict == PASS for entry in sharded)


@pytest.mark.parametrize("name", SHARDED_MIXER_FAMILIES)
def test_sharded_mixer_family_passes_at_sp4(zoo_sp4: dict[str, Outcome], name: str) -> None:
    outcome = zoo_sp4[name]
    assert outcome.verdict == PASS and outcome.sharded_mixers, (
        f"{name} at sp=4: {outcome.verdict} (loss error {outcome.loss_error}, update error {outcome.update_error}) "
        f"{outcome.reason}"
    )
