"""Nothing process-wide: importing the package adds no warning or log filter and changes no logger; the filters of
harmless third-party messages (:mod:`lightning_ulysses.quiet`) live as long as a strategy's run (set-up to teardown)
or a ``lightning-ulysses`` command; the set-up check's trap for local token indices sees ``torch.arange`` through a
torch function mode of its own thread and replaces nothing, also when the forward inside it raises."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy, quiet
from lightning_ulysses.cli import main
from lightning_ulysses.hf.check.training import local_index_trap
from tests.launch import REPO_ROOT, launch
from tests.tiny import TinyCausalLM, collate, cpu_trainer, make_samples

FILTERS_AROUND_IMPORT = """
import importlib, json, logging, sys, warnings

def state():
    loggers = {
        name: [logger.level, [id(f) for f in logger.filters], [id(h) for h in logger.handlers], logger.propagate,
               logger.disabled]
        for name, logger in [("", logging.getLogger()), *logging.root.manager.loggerDict.items()]
        if isinstance(logger, logging.Logger)
    }
    disable = logging.root.manager.disable
    return {"warnings": [repr(f) for f in warnings.filters], "loggers": loggers, "disable": disable}

for name in json.loads(sys.argv[1]):  # what importing the package imports, in its order
    importlib.import_module(name)
before = state()
import lightning_ulysses
print(json.dumps({"before": before, "after": state()}))
"""


def process_state() -> dict[str, Any]:
    """The warning filters and every logger's level, filters and handlers (by identity) of this process."""
    return {
        "warnings": list(warnings.filters),
        "loggers": {
            name: (logger.level, list(logger.filters), list(logger.handlers), logger.propagate, logger.disabled)
            for name, logger in [("", logging.getLogger()), *logging.root.manager.loggerDict.items()]
            if isinstance(logger, logging.Logger)
        },
    }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    """The same warning filters, and every logger as it was (one made since unconfigured)."""
    assert after["warnings"] == before["warnings"]
    changed = {
        name: (before["loggers"].get(name), state)
        for name, state in after["loggers"].items()
        if list(before["loggers"].get(name, (logging.NOTSET, [], [], True, False))) != list(state)
    }
    assert not changed, changed


def test_importing_the_package_leaves_warning_filters_and_logging_as_they_were() -> None:
    """A fresh process imports everything the package imports first, then the package: only the package's own
    (new, unconfigured) loggers may differ."""
    imported = subprocess.run(
        [sys.executable, "-c", "import json, sys, lightning_ulysses; print(json.dumps(list(sys.modules)))"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    dependencies = [n for n in json.loads(imported.stdout.splitlines()[-1]) if n.split(".")[0] != "lightning_ulysses"]
    dependencies = [n for n in dependencies if n != "__main__"]
    around = subprocess.run(
        [sys.executable, "-c", FILTERS_AROUND_IMPORT, json.dumps(dependencies)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert around.returncode == 0, around.stderr[-3000:]
    states = json.loads(around.stdout.splitlines()[-1])
    assert states["after"]["disable"] == states["before"]["disable"]
    assert_unchanged(states["before"], states["after"])


def test_filters_are_removed_as_they_were_added() -> None:
    before = process_state()
    warnings.filterwarnings(
        "ignore", message=r"The dirpath has changed from", module=r"lightning\.pytorch\.callbacks\.model_checkpoint"
    )
    existing = warnings.filters[0]  # one of quiet.CLI's, there before it: it stays
    installed = quiet.install(quiet.CLI)
    assert len(warnings.filters) == len(before["warnings"]) + 1 and not installed.warnings
    assert logging.getLogger("lightning.fabric.utilities.seed").filters
    installed.remove()
    assert warnings.filters[0] == existing
    warnings.filters.remove(existing)
    assert_unchanged(before, process_state())
    with quiet.installed(quiet.RUN):
        assert len(warnings.filters) == len(before["warnings"]) + len(quiet.RUN.warnings)
    assert_unchanged(before, process_state())


def test_a_command_leaves_the_filters_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    """Also a command that ends with an error (a refused config)."""
    import deepspeed  # noqa: F401 - the command imports it, and DeepSpeed configures its logger as it is imported

    monkeypatch.setattr(sys, "argv", ["lightning-ulysses"])
    refused = ["fit", "--config", str(REPO_ROOT / "configs/quickstart.yaml"), "--data.batch_size", "0"]
    before = process_state()
    with pytest.raises(SystemExit):
        main(refused)
    assert_unchanged(before, process_state())


class FiltersDuringFit(TinyCausalLM):
    def on_train_start(self) -> None:
        self.during = len(warnings.filters), logging.getLogger("DeepSpeed").filters[:]


def fit_worker(args: dict[str, Any]) -> dict[str, Any]:
    before = {"warnings": len(warnings.filters), "deepspeed": logging.getLogger("DeepSpeed").filters[:]}
    module = FiltersDuringFit()
    trainer = cpu_trainer(2, UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa"), max_steps=1)
    trainer.fit(module, DataLoader(make_samples(num=2, seq_len=16), batch_size=2, collate_fn=collate))
    after = {"warnings": len(warnings.filters), "deepspeed": logging.getLogger("DeepSpeed").filters[:]}
    during_warnings, during_deepspeed = module.during
    return {
        "restored": after == before,
        "added_during": (during_warnings - before["warnings"], len(during_deepspeed) - len(before["deepspeed"])),
    }


@pytest.mark.distributed
def test_a_run_has_the_filters_from_set_up_to_teardown() -> None:
    for result in launch("tests.test_process_state:fit_worker", 2):
        assert result["added_during"] == (len(quiet.RUN.warnings), len(quiet.RUN.logs))
        assert result["restored"]


class LocalIndices(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + torch.arange(x.shape[-1])


def test_the_local_index_trap_replaces_nothing_and_leaves_no_mode_behind() -> None:
    original, modes = torch.arange, torch._C._len_torch_function_stack()
    model = LocalIndices()
    other_thread: list[Any] = []
    with pytest.raises(ValueError, match="the forward failed"), local_index_trap(model, 5) as found:
        assert torch.arange is original
        model(torch.zeros(5))
        # another thread's modules are not this probe's: its torch calls do not reach the trap
        thread = threading.Thread(target=lambda: other_thread.append(torch._C._len_torch_function_stack()))
        thread.start()
        thread.join()
        raise ValueError("the forward failed")
    assert len(found) == 1 and "torch.arange at test_process_state.py" in found[0].problem, found
    assert other_thread == [0]
    assert torch.arange is original and torch._C._len_torch_function_stack() == modes


def zero3_release_worker(args: dict[str, Any]) -> dict[str, Any]:
    from deepspeed.runtime.zero import parameter_offload

    stack_before = list(parameter_offload.FWD_MODULE_STACK)
    module = TinyCausalLM()
    trainer = cpu_trainer(1, UlyssesStrategy(sp_size=1, stage=3, attn_implementation="sdpa"), max_steps=1)
    trainer.fit(module, DataLoader(make_samples(num=2, seq_len=16), batch_size=2, collate_fn=collate))
    held = [type(m).__name__ for m in parameter_offload.FWD_MODULE_STACK if module in list(m.modules())]
    return {"stack_as_before": stack_before == parameter_offload.FWD_MODULE_STACK, "held": held}


@pytest.mark.distributed
def test_a_zero3_fit_leaves_no_module_in_deepspeeds_module_stack() -> None:
    """DeepSpeed's ZeRO-3 (0.19.8) keeps each engine's top module in its module-level ``FWD_MODULE_STACK`` for the
    life of the process (with the weights and optimizer state it reaches); the strategy's teardown takes it out."""
    (result,) = launch("tests.test_process_state:zero3_release_worker", 1)
    assert result == {"stack_as_before": True, "held": []}
