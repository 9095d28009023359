"""Preemption loses nothing: a run interrupted anywhere resumes at exactly the next untrained batch.

One chain of fits on 2 processes (sp=2, ZeRO-3, SGD with momentum, 2 micro-batches per optimizer step, 2 epochs
of 4 steps). Each fit is interrupted at another point and the next resumes from the checkpoint it left; the
last runs to the end:

* SIGTERM or SLURM's requeue signal (SIGUSR1 under ``SLURMEnvironment(auto_requeue=True)``, a fake ``scontrol``)
  sent to one rank before the backward, during it, after it (at the end of an epoch), and in the forward or the
  backward of a layer drawn at random: every rank must save at the next optimizer step's start and leave ``fit``
  with ``SIGTERMException``;
* ``trainer.save_checkpoint`` followed by a crash, from inside ``training_step`` during accumulation, right after
  the optimizer step, and in ``on_train_batch_end`` of a micro-batch that does not end a step (one resume on
  ``sp=1 x dp=2``).

Each resumed fit must start at the step its checkpoint holds and train the reference batches from there (micro-batch
losses ``rtol=1e-5``); the last one's weights must equal one process trained without interruption (relative update
error ``< 1e-4``); every rank must exit by itself, with status 0.
"""

from __future__ import annotations

import os
import random
import signal
import stat
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesStrategy
from tests.launch import launch_to_exit
from tests.tiny import (
    TinyCausalLM,
    collate,
    cpu_trainer,
    gathered_parameters,
    make_samples,
    reference_training,
    relative_update_error,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

DATA = dict(num=16, seq_len=16, seed=5)
BATCH, ACCUMULATE, STEPS_PER_EPOCH, EPOCHS = 2, 2, 4, 2  # 8 batches an epoch
LR, MOMENTUM, STAGE = 0.5, 0.9, 3
SLURM_JOB_ID = "4242"
# what interrupts each fit: (epoch, batch) where it happens, the rank a signal goes to, and the step the next fit
# must resume at (the preemption checkpoint holds every step completed before the next step's start)
LINKS: list[dict[str, Any]] = [
    dict(name="sigterm_before_backward", signal=signal.SIGTERM, rank=1, at=(0, 2), point="training_step", resumes=2),
    dict(
        name="sigusr1_during_backward",
        signal=signal.SIGUSR1,
        rank=0,
        at=(0, 5),
        point="backward",
        slurm=True,
        resumes=3,
    ),
    dict(
        name="sigterm_after_backward_at_epoch_end",
        signal=signal.SIGTERM,
        rank=0,
        at=(0, 7),
        point="after_backward",
        resumes=4,
    ),
    dict(name="save_in_training_step_during_accumulation", at=(1, 1), point="training_step", resumes=4),
    dict(name="save_after_optimizer_step_on_dp2", at=(1, 3), point="optimizer_step", resumes=6, sp=1),
    dict(name="save_in_train_batch_end_during_accumulation", at=(1, 4), point="train_batch_end", resumes=6),
    # within the forward or backward of the next 2 micro-batches: saved before the step after them
    dict(name="sigterm_in_a_random_layer", signal=signal.SIGTERM, rank=1, point="random", resumes=7),
    dict(name="rest"),
]


class Crash(Exception):
    """The process dies right after a checkpoint was saved."""


class InterruptedCausalLM(TinyCausalLM):
    """Interrupts its fit as ``link`` says: sends the signal to this process if it is the link's rank, or saves a
    checkpoint to ``path`` on every rank and crashes."""

    def __init__(self, link: dict[str, Any], path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.link, self.path = link, path
        self.start_step: int | None = None
        self.random_point: str | None = None
        self._hooks: list[Any] = []

    def _here(self, point: str, batch_idx: int) -> bool:
        return self.link.get("point") == point and (self.current_epoch, batch_idx) == self.link["at"]

    def _interrupt(self) -> None:
        if "signal" not in self.link:
            self.trainer.save_checkpoint(self.path)
            raise Crash
        if self.global_rank == self.link["rank"]:
            os.kill(os.getpid(), self.link["signal"])

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step
        if self.link.get("point") == "random" and self.global_rank == self.link["rank"]:
            self._interrupt_at_random()

    def _interrupt_at_random(self) -> None:
        """Signal in the forward, or the backward, of a module call drawn from the next 2 micro-batches' (every
        module runs at least once a micro-batch)."""
        # containers (ModuleList, ModuleDict) have no forward of their own
        modules = [m for m in self.model.modules() if not isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))]
        countdown, in_backward = [random.randrange(2 * len(modules))], random.random() < 0.5
        self.random_point = f"module call {countdown[0]}, {'backward' if in_backward else 'forward'}"

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            countdown[0] -= 1
            if countdown[0] == -1:
                if in_backward and isinstance(output, Tensor) and output.requires_grad:
                    output.register_hook(lambda grad: self._interrupt())
                else:
                    self._interrupt()

        self._hooks = [module.register_forward_hook(hook) for module in modules]

    def on_train_end(self) -> None:
        for handle in self._hooks:
            handle.remove()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self._here("training_step", batch_idx):
            self._interrupt()
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        if self._here("backward", batch_idx):
            logits.register_hook(lambda grad: self._interrupt())  # runs in the middle of the backward
        loss = self.causal_lm_loss(logits, batch["shift_labels"])
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if self._here("after_backward", self.trainer.fit_loop.epoch_loop.batch_idx):
            self._interrupt()

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self._here("optimizer_step", self.trainer.fit_loop.epoch_loop.batch_idx):
            self._interrupt()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._here("train_batch_end", batch_idx):
            self._interrupt()


@contextmanager
def fake_slurm_job(directory: Path, rank: int) -> Iterator[Path]:
    """SLURM's variables for a 2-task job on one node, and an ``scontrol`` on PATH that logs its arguments."""
    bin_dir, log = directory / "bin", directory / "scontrol.log"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    variables = {
        "SLURM_JOB_ID": SLURM_JOB_ID,
        "SLURM_JOB_NAME": "ulysses-test",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield log
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def chain_worker(args: dict[str, Any]) -> dict[str, Any]:
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])  # read once: teardown deletes them
    directory = Path(args["dir"])
    random.seed(args["seed"])
    ckpt_path, links = None, []
    for link in args["links"]:
        sp = link.get("sp", 2)
        module = InterruptedCausalLM(link, str(directory / "saved.ckpt"), lr=LR, momentum=MOMENTUM)
        strategy = UlyssesStrategy(sp_size=sp, stage=STAGE, attn_implementation="sdpa")
        outcome = "completed"
        with fake_slurm_job(directory, rank) if link.get("slurm") else nullcontext():
            trainer = cpu_trainer(
                world_size,
                strategy,
                max_epochs=EPOCHS,
                accumulate_grad_batches=ACCUMULATE,
                default_root_dir=str(directory),
                plugins=[SLURMEnvironment(auto_requeue=True)] if link.get("slurm") else None,
            )
            loader = DataLoader(make_samples(**DATA), batch_size=BATCH * sp // 2, collate_fn=collate)
            try:
                trainer.fit(module, loader, ckpt_path=ckpt_path)
            except SIGTERMException:
                outcome, ckpt_path = "preempted", str(directory / "hpc_ckpt_1.ckpt")
            except Crash:
                outcome, ckpt_path = "crashed after saving", module.path
        links.append(
            dict(
                name=link["name"],
                outcome=outcome,
                start_step=module.start_step,
                losses=module.losses,
                dp=2 // sp,
                global_step=trainer.global_step,
                random_point=module.random_point,
            )
        )
        if outcome == "completed":
            break
    return {"links": links, "params": gathered_parameters(module.model, STAGE == 3)}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("preemption")
    seed = int.from_bytes(os.urandom(4), "little")  # the random layer differs from run to run; failures name the seed
    exits = launch_to_exit(
        "tests.test_preemption:chain_worker", 2, {"links": LINKS, "dir": str(directory), "seed": seed}, timeout=600
    )
    return {"exits": exits, "dir": directory, "seed": seed}


def _outcome(link: dict[str, Any]) -> str:
    return "preempted" if "signal" in link else "crashed after saving" if "point" in link else "completed"


def test_every_rank_exits_by_itself(chain: dict[str, Any]) -> None:
    for rank, exit in enumerate(chain["exits"]):
        assert exit.returncode == 0, (
            f"rank {rank} exit {exit.returncode} (seed {chain['seed']}):\n{exit.output[-5000:]}"
        )


def test_each_fit_resumes_at_the_next_untrained_batch_and_trains_the_same_batches(chain: dict[str, Any]) -> None:
    results = [exit.result for exit in chain["exits"]]
    expected_losses, _ = reference_training(
        make_samples(**DATA),
        steps=STEPS_PER_EPOCH,
        batch_size=BATCH,
        accumulate=ACCUMULATE,
        lr=LR,
        momentum=MOMENTUM,
        epochs=EPOCHS,
    )
    links = results[0]["links"]
    assert [link["name"] for link in links] == [link["name"] for link in LINKS]
    for index, link in enumerate(links):
        random_points = [result["links"][index]["random_point"] for result in results]
        where = f"{link['name']} (seed {chain['seed']}, {random_points})"
        assert link["start_step"] == (LINKS[index - 1]["resumes"] if index else 0), f"{where}: {link['start_step']}"
        assert link["outcome"] == _outcome(LINKS[index]), where
        start = link["start_step"] * ACCUMULATE  # micro-batches of the run before this fit
        losses = torch.tensor([result["links"][index]["losses"] for result in results])
        if link["dp"] == 2:  # each rank holds half of every micro-batch, with the same number of tokens
            losses = losses.mean(dim=0, keepdim=True)
        for rank_losses in losses:
            torch.testing.assert_close(
                rank_losses,
                torch.tensor(expected_losses[start : start + len(rank_losses)]),
                rtol=1e-5,
                atol=0,
                msg=f"{where}: micro-batch losses from micro-batch {start}",
            )
    assert links[-1]["global_step"] == EPOCHS * STEPS_PER_EPOCH


def test_resumed_weights_equal_the_uninterrupted_run(chain: dict[str, Any]) -> None:
    _, expected = reference_training(
        make_samples(**DATA),
        steps=STEPS_PER_EPOCH,
        batch_size=BATCH,
        accumulate=ACCUMULATE,
        lr=LR,
        momentum=MOMENTUM,
        epochs=EPOCHS,
    )
    initial = {name: p.detach() for name, p in tiny_llama().named_parameters()}
    for rank, exit in enumerate(chain["exits"]):
        error = relative_update_error(initial, expected, exit.result["params"])
        assert error < 1e-4, f"rank {rank} (seed {chain['seed']}): weights vs one process, relative error {error:.2e}"


def test_the_requeue_signal_requeues_the_slurm_job_once(chain: dict[str, Any]) -> None:
    assert (chain["dir"] / "scontrol.log").read_text().split("\n") == [f"requeue {SLURM_JOB_ID}", ""]
