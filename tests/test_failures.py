"""Failures end every rank with an error, within a bounded time, never a hang; or skip the step, if asked.

The failing processes run under :func:`tests.launch.launch_to_exit`, which never stops a rank because
another failed: each rank must exit on its own, with an error, before the launcher's timeout.

``nonfinite_loss="skip"``: a NaN loss on one rank of an SP group must leave the weights and the SGD
momentum as they were, so the run must equal one process that trains on the same batches minus the
skipped step's (weights: relative update error ``< 1e-4``; a step applied with NaN gradients gives NaN,
a zero-gradient step applied with momentum gives an error near 1).
"""

from __future__ import annotations

import os
import re
import time
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import LlamaConfig, PretrainedConfig

from lightning_ulysses import SequenceParallelMonitor, UlyssesStrategy
from lightning_ulysses.callbacks import format_summary
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.memory.estimate import DecoderShape, peak_bytes_per_token
from lightning_ulysses.runtime.failures import Heartbeat, NonFiniteLossGuard
from lightning_ulysses.runtime.out_of_memory import StepShape, out_of_memory_advice
from lightning_ulysses.sharding import prepare_batch
from tests.launch import RankExit, launch, launch_to_exit
from tests.tiny import (
    VOCAB,
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

PG_TIMEOUT_S = 20  # also bounds start-up collectives: leave room for ranks that start unevenly on a loaded machine
STALL_S = PG_TIMEOUT_S + 10  # rank 0 times out while rank 1 still sleeps: it never sees rank 1 exit
START_UP_S = 120  # process start-up, imports and DeepSpeed set-up on a loaded 2-core machine
NONFINITE_REPORTED = "non-finite loss reported: "


class FailingCausalLM(TinyCausalLM):
    """At batch 1, on rank ``fail_rank``: returns a NaN loss (``"nan"``), or stalls ``STALL_S`` seconds
    (its peers block in a collective) and then raises (``"stall_then_raise"``)."""

    def __init__(self, mode: str, fail_rank: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mode, self.fail_rank = mode, fail_rank

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        failing = self.global_rank == self.fail_rank and batch_idx == 1
        if failing and self.mode == "stall_then_raise":
            time.sleep(STALL_S)
            raise RuntimeError(f"rank {self.global_rank} fails on purpose at batch {batch_idx}")
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if failing else loss


def _fit(mode: str, sp: int, world_size: int) -> None:
    strategy = UlyssesStrategy(sp_size=sp, stage=2, attn_implementation="sdpa", timeout=timedelta(seconds=PG_TIMEOUT_S))
    trainer = cpu_trainer(world_size, strategy, max_steps=4)
    loader = DataLoader(make_samples(num=16, seq_len=16), batch_size=2, collate_fn=collate)
    trainer.fit(FailingCausalLM(mode, fail_rank=1), loader)


def failing_worker(args: dict[str, Any]) -> None:
    """A NaN loss on rank 1 under dp=2 (caught, so the processes go on), then a stall and a raise on rank 1 under
    sp=2."""
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown deletes it
    try:
        _fit("nan", sp=1, world_size=world_size)
    except FloatingPointError as error:
        print(NONFINITE_REPORTED + str(error), flush=True)
    _fit("stall_then_raise", sp=2, world_size=world_size)


class FailingOptimizerSetup(TinyCausalLM):
    """Rank 1 fails while building its optimizer: its peer waits in DeepSpeed's engine set-up."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.global_rank == 1:
            raise RuntimeError("rank 1 fails on purpose in configure_optimizers")
        return super().configure_optimizers()


def failing_setup_worker(args: dict[str, Any]) -> None:
    strategy = UlyssesStrategy(sp_size=2, stage=2, attn_implementation="sdpa", timeout=timedelta(seconds=PG_TIMEOUT_S))
    trainer = cpu_trainer(2, strategy, max_steps=1)
    trainer.fit(FailingOptimizerSetup(), DataLoader(make_samples(num=4, seq_len=16), batch_size=2, collate_fn=collate))


def test_rank_failing_before_the_engine_exists_ends_every_rank_within_the_timeout() -> None:
    # DeepSpeed's own clone of the world group used torch's 30-minute default; the launcher allows far less
    exits = launch_to_exit("tests.test_failures:failing_setup_worker", 2, timeout=START_UP_S + 2 * PG_TIMEOUT_S)
    for rank, exit in enumerate(exits):
        assert exit.returncode not in (None, 0), f"rank {rank} did not end with an error:\n{exit.output[-3000:]}"
    assert "rank 1 fails on purpose in configure_optimizers" in exits[1].output


@pytest.fixture(scope="module")
def exits() -> list[RankExit]:
    return launch_to_exit("tests.test_failures:failing_worker", 2, timeout=START_UP_S + STALL_S + 2 * PG_TIMEOUT_S)


def test_nonfinite_loss_stops_every_rank_naming_step_and_ranks(exits: list[RankExit]) -> None:
    for rank, exit in enumerate(exits):
        assert (
            NONFINITE_REPORTED + "Non-finite training loss at global step 1 (batch 1 of the epoch) on ranks [1]."
            in (exit.output)
        ), f"rank {rank}:\n{exit.output[-3000:]}"


def test_rank_stalling_then_raising_ends_every_rank_with_an_error(exits: list[RankExit]) -> None:
    for rank, exit in enumerate(exits):
        assert exit.returncode is not None, (
            f"rank {rank} was still running at the launcher's timeout:\n{exit.output[-3000:]}"
        )
        assert exit.returncode != 0, f"rank {rank} exited cleanly after its peer failed:\n{exit.output[-3000:]}"
    assert "RuntimeError: rank 1 fails on purpose at batch 1" in exits[1].output
    # rank 0 must not wait for rank 1's exit: its SP collective gives up after the strategy's timeout
    assert "Timed out" in exits[0].output and "Connection closed by peer" not in exits[0].output, exits[0].output[
        -3000:
    ]


def test_batch_that_cannot_be_sharded_is_refused_with_its_shape() -> None:
    batch = {"input_ids": torch.ones(2, 16, dtype=torch.long), "pixel_values": torch.ones(3, 16)}
    with pytest.raises(ValueError, match=r"'pixel_values' with shape \(3, 16\).*\[batch=2, seq=16"):
        prepare_batch(batch, sp_size=2)


SKIP_DATA = dict(num=16, seq_len=16)
SKIP_LR, SKIP_MOMENTUM, SKIP_BATCH, SKIP_STEPS = 0.5, 0.9, 2, 4
# (ZeRO stage, accumulate_grad_batches); the NaN comes at batch 1, so in optimizer step 1 // accumulate
SKIP_CASES = [(1, 1), (2, 1), (3, 1), (2, 2)]


def skipping_worker(args: dict[str, Any]) -> dict[str, Any]:
    """sp=2; rank 1's loss is NaN at batch 1 under nonfinite_loss='skip'; then ZeRO stage 0, which cannot skip."""
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown deletes it
    results: dict[str, Any] = {}
    for stage, accumulate in SKIP_CASES:
        module = FailingCausalLM("nan", fail_rank=1, lr=SKIP_LR, momentum=SKIP_MOMENTUM)
        strategy = UlyssesStrategy(sp_size=2, stage=stage, attn_implementation="sdpa", nonfinite_loss="skip")
        monitor = SequenceParallelMonitor()
        trainer = cpu_trainer(
            world_size, strategy, max_steps=SKIP_STEPS, callbacks=[monitor], accumulate_grad_batches=accumulate
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, DataLoader(make_samples(**SKIP_DATA), batch_size=SKIP_BATCH, collate_fn=collate))
        results[f"zero{stage}_accumulate{accumulate}"] = dict(
            losses=module.losses,
            weights=gathered_parameters(module.model, stage == 3),
            skipped=strategy.nonfinite_loss.skipped_steps,
            steps=trainer.global_step,
            warnings=[str(w.message) for w in caught],
            summary=format_summary(monitor.summary, strategy, trainer.global_step),
        )
    try:
        _fit_stage_0_skip(world_size)
    except ValueError as error:
        results["stage_0_error"] = str(error)
    return results


def _fit_stage_0_skip(world_size: int) -> None:
    strategy = UlyssesStrategy(sp_size=2, stage=0, attn_implementation="sdpa", nonfinite_loss="skip")
    trainer = cpu_trainer(world_size, strategy, max_steps=1)
    trainer.fit(TinyCausalLM(), DataLoader(make_samples(**SKIP_DATA), batch_size=SKIP_BATCH, collate_fn=collate))


@pytest.fixture(scope="module")
def skipped() -> list[dict[str, Any]]:
    return launch("tests.test_failures:skipping_worker", 2)


@pytest.mark.parametrize(("stage", "accumulate"), SKIP_CASES)
def test_nonfinite_loss_skips_the_step_leaving_weights_and_momentum(
    skipped: list[dict[str, Any]], stage: int, accumulate: int
) -> None:
    skipped_step = 1 // accumulate
    expected_losses, expected = reference_training(
        make_samples(**SKIP_DATA),
        steps=SKIP_STEPS,
        batch_size=SKIP_BATCH,
        accumulate=accumulate,
        lr=SKIP_LR,
        momentum=SKIP_MOMENTUM,
        skip_steps=(skipped_step,),
    )
    initial = {name: p.detach() for name, p in tiny_llama().named_parameters()}
    for rank, result in enumerate(skipped):
        got = result[f"zero{stage}_accumulate{accumulate}"]
        assert got["steps"] == SKIP_STEPS and got["skipped"] == [skipped_step]
        assert re.search(rf"skipped \(non-finite loss\) +1: steps \[{skipped_step}\]", got["summary"]), got["summary"]
        if rank == 0:  # a rank-zero warning
            assert (
                f"Skipped global step {skipped_step}: non-finite training loss at global step {skipped_step} "
                f"(batch 1 of the epoch) on ranks [1]." in got["warnings"]
            ), got["warnings"]
        # every micro-batch loss as computed before rank 1 turns it into NaN
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        error = relative_update_error(initial, expected, got["weights"])
        assert error < 1e-4, f"ZeRO-{stage} rank {rank}: weights vs one process without the skipped step, {error:.2e}"


def test_nonfinite_skip_is_refused_where_deepspeed_would_apply_the_step(skipped: list[dict[str, Any]]) -> None:
    for result in skipped:
        assert "ZeRO stage 0 does not do in fp32. Use stage=1, 2 or 3" in result.get("stage_0_error", ""), result


def test_nonfinite_loss_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="nonfinite_loss must be 'raise', 'skip' or 'off', got 'ignore'"):
        UlyssesStrategy(sp_size=2, nonfinite_loss="ignore")


def test_skipping_stops_when_every_step_is_non_finite(one_rank: None) -> None:
    guard = NonFiniteLossGuard("skip", max_consecutive_skips=3)
    nan, finite = torch.tensor(float("nan")), torch.tensor(1.0)
    with pytest.warns(UserWarning, match="Skipped global step"):
        for step, (loss, applied) in enumerate(
            [(nan, False), (nan, False), (finite, True), (nan, False), (nan, False)]
        ):
            guard.check_loss(loss, step, batch_idx=step)
            guard.check_step(applied, step)  # a finite step in between starts the count again
    assert guard.skipped_steps == [0, 1, 3, 4]
    guard.check_loss(nan, 5, batch_idx=5)
    with pytest.raises(FloatingPointError, match=r"global step 5 .* and 3 optimizer steps in a row skipped"):
        guard.check_step(False, 5)


def test_heartbeats_name_the_ranks_that_vanished_not_those_that_left() -> None:
    """Without processes: three heartbeats on one store; rank 1's stops without leaving (as in a process killed by
    SIGKILL), rank 2 leaves in order (its run ended, or its own error is on its way out), then runs again and
    vanishes."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False)
    beats = [Heartbeat(store, rank, 3, period=0.2) for rank in range(3)]
    for beat in beats:
        beat.start()
    time.sleep(0.5)
    assert beats[0].dead_ranks_report() is None
    beats[1]._stop.set()  # the thread stops, and nothing else happens
    beats[1]._thread.join()
    beats[2].stop()
    report = beats[0].dead_ranks_report()
    assert report is not None and report.startswith("rank 1 stopped: no heartbeat for 0.5 s"), report
    again = Heartbeat(store, 2, 3, period=0.2)  # the next fit of that process
    again.start()
    again._stop.set()
    again._thread.join()
    assert beats[0].dead_ranks_report().startswith("ranks 1, 2 stopped")
    beats[0].stop()


class OutOfMemoryLM(TinyCausalLM):
    """Its step asks the CPU allocator for 1 PiB: a real ``DefaultCPUAllocator: can't allocate memory``."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        torch.empty(1 << 50, dtype=torch.uint8)
        return super().training_step(batch, batch_idx)


def out_of_memory_worker(args: dict[str, Any]) -> None:
    strategy = UlyssesStrategy(sp_size=2, attn_implementation="sdpa", tiled_loss=True)
    trainer = cpu_trainer(2, strategy, max_steps=1)
    trainer.fit(OutOfMemoryLM(), DataLoader(make_samples(4, 16), batch_size=2, collate_fn=collate))


def _mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB"


def _kib(size: float) -> str:
    return f"{size / 2**10:.1f} KiB"


def test_out_of_memory_line_estimates_the_activations_now_with_the_options_and_at_a_larger_sp_size() -> None:
    """Without processes: the shape of a tiny Llama and of a [2, 20001] batch, read as the strategy reads them; the
    line's estimates are the analytic model's bytes per token times the padded tokens per rank (20002 at sp_size=2,
    10002 at 4), with the suggested options in the order they are named."""
    step = StepShape.read(TinyCausalLM(), (2, 20001))
    assert step is not None
    tiny = DecoderShape(hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=VOCAB)
    assert (step.decoder, step.element_bytes) == (tiny, 4)
    assert (step.tokens_per_rank(2), step.tokens_per_rank(4)) == (20002, 10002)
    now = peak_bytes_per_token(tiny, 4, tiled_loss=True) * 20002
    on = dict(tiled_mlp=True, tiled_loss=True, checkpointing=True, offload=True)
    with_options, at_4 = peak_bytes_per_token(tiny, 4, **on) * 20002, peak_bytes_per_token(tiny, 4, **on) * 10002
    # the options more than halve it here, and twice the ranks halve it again (up to the padding)
    assert now > 2 * with_options > 0 and with_options == pytest.approx(2 * at_4, rel=1e-3)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity ...")
    line = out_of_memory_advice(error, MemoryOptions(tiled_loss=True), None, 2, 8, on_cuda=True, step=step)
    assert line == (
        "lightning-ulysses: out of memory (an allocation of 2.00 GiB failed) at sp_size=2 (each rank holds 1/2 of "
        "every sequence); estimated activations per rank at 20,002 tokens (weights, gradients and optimizer states "
        f"not counted): {_mib(now)} now, {_mib(with_options)} with tiled_mlp, activation_checkpointing, "
        f"offload_activations, {_mib(at_4)} at sp_size=4. To fit the sequence, turn on UlyssesStrategy(tiled_mlp=True, "
        "activation_checkpointing=True, offload_activations=True, head_chunks='auto'), use a larger sp_size (one of "
        "[4, 8]), or shorten it; docs/memory.md gives the peak per token under each option (python -m "
        "benchmarks.memory_model estimates it for a model's shape)."
    )
    # the Llama-3.1-8B config gives the benchmark's shape; without a transformers model the line has no estimate
    from benchmarks.memory_model import LLAMA_31_8B

    llama_8b = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    assert DecoderShape.from_config(llama_8b) == LLAMA_31_8B
    assert DecoderShape.from_config(PretrainedConfig()) is None
    assert StepShape.read(torch.nn.Linear(2, 2), (2, 20001)) is None
    assert "estimated" not in out_of_memory_advice(error, MemoryOptions(), None, 2, 8, on_cuda=True, step=None)


def test_out_of_memory_says_in_one_line_what_would_fit_the_sequence() -> None:
    """Both ranks run out of memory in their step: one line for the run (rank 0's) names the options that are off,
    the layout and the estimated activations of the failing [2, 16] batch (16 tokens per rank; on CPU offload is
    not suggested); each rank's traceback still ends in the allocator's own error."""
    exits = launch_to_exit("tests.test_failures:out_of_memory_worker", 2, timeout=START_UP_S + 60)
    lines = [line for e in exits for line in e.output.splitlines() if "lightning-ulysses: out of memory" in line]
    assert len(lines) == 1, [e.output[-3000:] for e in exits]
    tiny = DecoderShape(hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2, head_dim=8, vocab=VOCAB)
    now = peak_bytes_per_token(tiny, 4, tiled_loss=True) * 16
    with_options = peak_bytes_per_token(tiny, 4, tiled_mlp=True, tiled_loss=True, checkpointing=True) * 16
    assert lines[0].endswith(
        "lightning-ulysses: out of memory (an allocation of 1048576.00 GiB failed) at sp_size=2 (each rank holds "
        "1/2 of every sequence); estimated activations per rank at 16 tokens (weights, gradients and optimizer states "
        f"not counted): {_kib(now)} now, {_kib(with_options)} with tiled_mlp, activation_checkpointing. To fit the "
        "sequence, turn on UlyssesStrategy(tiled_mlp=True, "
        "activation_checkpointing=True, head_chunks='auto'), use more processes and a larger sp_size, or shorten it; "
        "docs/memory.md gives the peak per token under each option (python -m benchmarks.memory_model estimates it "
        "for a model's shape)."
    ), lines[0]
    for e in exits:
        assert e.returncode not in (0, None) and "DefaultCPUAllocator: can't allocate memory" in e.output
