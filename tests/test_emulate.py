"""benchmarks.emulate: rank 0 of an sp=4 step on CPU in one process, with the real per-rank shapes and bytes.

The emulated peers hand rank 0 its own all-to-all blocks back, so its loss and gradients are not the real run's:
exactness is meaningless here and is tested where the strategy runs real ranks. What is tested is what the emulation
is for: the shapes rank 0 computes on, the bytes it would send, the documents its attention sees, the activations it
keeps (against a real sp=2 run: the one multi-process test), and the arithmetic of the estimate.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig

from benchmarks.emulate import (
    Estimate,
    StepMeasurement,
    emulated_world,
    estimate,
    extrapolate,
    main,
    parameter_counts,
    patched_rank,
    peers_of,
    run_rank0,
    zero3_bytes,
)
from benchmarks.gpu_long_context import llama_config
from benchmarks.measure import SavedForBackward
from lightning_ulysses.attention import documents_of
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.sharding import prepare_batch, shard_batch
from lightning_ulysses.topology import SequenceParallelTopology
from tests.launch import launch

SP, SEQ_LEN = 4, 96
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4, vocab_size=128)
HEAD_DIM = 64 // 8


def config(layers: int) -> LlamaConfig:
    return LlamaConfig(
        **SHAPE,
        num_hidden_layers=layers,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )


def run(groups: SequenceParallelGroups, layers: int, option: str) -> StepMeasurement:
    return run_rank0(groups, config(layers), SEQ_LEN, option, torch.device("cpu"), torch.float32, steps=1)


def off_device_bytes_per_pass(layers: int, element_bytes: int = 4) -> int:
    """Plain Ulysses, one pass: q, k, v of this rank's ``n`` tokens out (``H + 2 H_kv`` heads), the attention output
    back (``H`` heads), of which the ``sp - 1`` blocks for the other ranks leave the device."""
    n = SEQ_LEN // SP
    heads = 2 * SHAPE["num_attention_heads"] + 2 * SHAPE["num_key_value_heads"]
    return layers * n * heads * HEAD_DIM * element_bytes * (SP - 1) // SP


def test_emulated_rank_has_the_real_shapes_and_moves_the_formula_bytes() -> None:
    with emulated_world(SP) as groups:
        plain = [run(groups, layers, "plain") for layers in (1, 2)]
        checkpointed = run(groups, 2, "checkpointing")
    n, heads, kv_heads = SEQ_LEN // SP, SHAPE["num_attention_heads"] // SP, SHAPE["num_key_value_heads"] // SP
    for measured in [*plain, checkpointed]:
        # every decoder layer of rank 0 holds N / sp tokens of the whole hidden state
        assert measured.layer_inputs == [(1, n, SHAPE["hidden_size"])] * measured.layers
        # q, k, v leave as [sp, B, n, (H/sp + 2 H_kv/sp) * D] and the output comes back as [sp, B, n, H/sp * D]:
        # rank 0 attends over sp * n = N tokens of H / sp heads
        shapes = {a.shape for a in measured.all_to_alls}
        assert shapes == {(SP, 1, n, (heads + 2 * kv_heads) * HEAD_DIM), (SP, 1, n, heads * HEAD_DIM)}
    assert [m.off_device_bytes for m in plain] == [(off_device_bytes_per_pass(d),) * 2 for d in (1, 2)]
    # checkpointing: the backward recomputes each layer's forward, all-to-alls included
    assert checkpointed.off_device_bytes == (off_device_bytes_per_pass(2), 2 * off_device_bytes_per_pass(2))

    layers = 32
    result = estimate(plain[0], plain[1], layers, link_gbps=100.0, zero3=(1.0, 2.0))
    assert result.off_device_per_layer == (off_device_bytes_per_pass(1),) * 2
    assert result.comm == pytest.approx(layers * 2 * off_device_bytes_per_pass(1) / 100e9)
    slope = plain[1].step_time - plain[0].step_time
    assert result.compute == pytest.approx(plain[0].step_time + (layers - 1) * slope)
    assert result.memory == pytest.approx(plain[0].peak_bytes + (layers - 1) * result.activation_peak_per_layer + 3)


@pytest.mark.cuda
def test_emulated_rank_on_cuda_with_alst_options() -> None:
    """bf16 on the GPU with ALST's options (offload on its side stream, the tiled loss and MLP): the CUDA backward
    (autograd's device thread) is told from the forward, the recomputation's all-to-alls counted with it."""
    with emulated_world(SP, "cuda") as groups:
        measured = run_rank0(groups, config(2), SEQ_LEN, "alst", torch.device("cuda"), torch.bfloat16, steps=1)
    assert measured.layer_inputs == [(1, SEQ_LEN // SP, SHAPE["hidden_size"])] * 2
    assert measured.off_device_bytes == (off_device_bytes_per_pass(2, 2), 2 * off_device_bytes_per_pass(2, 2))
    assert measured.step_time > 0 and measured.peak_bytes > 0


REAL_SP = 2
REAL_OPTIONS = ("plain", "checkpointing")


def real_rank_worker(args: dict[str, Any]) -> dict[str, int]:
    """One rank of a real sp=2 gloo run of the emulation's model and path (the strategy's mesh over gloo): what its
    forward saved for the backward."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = SequenceParallelGroups.create(SequenceParallelTopology(REAL_SP, REAL_SP, rank), "cpu")
    whole = prepare_batch({"input_ids": torch.randint(0, SHAPE["vocab_size"], (1, SEQ_LEN))}, REAL_SP)
    saved_bytes = {}
    for option in REAL_OPTIONS:
        model, loss = patched_rank(groups, config(2), option, torch.device("cpu"), torch.float32, "sdpa")
        with SavedForBackward() as saved:
            value = loss.forward_causal_lm_loss(model, shard_batch(whole, rank, REAL_SP))
        value.backward()
        saved_bytes[option] = saved.bytes
    dist.destroy_process_group()
    return saved_bytes


def test_emulated_rank_saves_what_a_real_rank_saves() -> None:
    """The activations rank 0 keeps for the backward, byte for byte, in the emulation and in a real sp=2 run."""
    real = launch("tests.test_emulate:real_rank_worker", REAL_SP, {})
    with emulated_world(REAL_SP) as groups:
        emulated = {option: run(groups, 2, option).saved_bytes for option in REAL_OPTIONS}
    assert real[0] == real[1] == emulated
    assert emulated["checkpointing"] < emulated["plain"]


def test_emulated_all_gather_returns_the_batch_so_attention_sees_its_documents() -> None:
    """Rank 0's shard of the batch's position ids gathers to the whole row (one document of N tokens, as in the real
    run); any other tensor gathers to sp copies, and a sum over the group counts sp mirrored ranks (the SP group of the
    strategy's mesh over the emulated world)."""
    whole = prepare_batch({"input_ids": torch.zeros(1, SEQ_LEN, dtype=torch.long)}, SP)
    with emulated_world(SP) as groups:
        peers_of(groups).hold(whole["position_ids"])
        shard = shard_batch(whole, 0, SP)["position_ids"]
        documents = documents_of(shard, groups)
        assert documents.offsets == (0, SEQ_LEN)
        other = [torch.empty(2) for _ in range(SP)]
        dist.all_gather(other, torch.tensor([1.0, 2.0]), group=groups.sp)
        assert all(torch.equal(t, torch.tensor([1.0, 2.0])) for t in other)
        total = torch.tensor([3.0])
        dist.all_reduce(total, group=groups.sp)
        assert total.item() == 3.0 * SP
    assert not dist.is_initialized()


def test_zero3_accounting_of_llama_8b() -> None:
    """16 B per parameter over 8 ranks: Llama-3.1-8B's 8.03 B parameters are 16 GB a rank; the working set is the
    gathered LM head (525 M parameters, bf16), one layer prefetched and one reduce bucket."""
    counts = parameter_counts(llama_config("8b", 1024))
    assert counts["total"] == pytest.approx(8.03e9, rel=0.01) and counts["largest"] == 128256 * 4096
    state, working = zero3_bytes(counts, world=8, state_bytes_per_param=16)
    assert state == counts["total"] * 2
    assert working == 2 * (128256 * 4096 + counts["layer"]) + 2 * 200_000_000


def test_extrapolation_is_linear_in_memory_and_quadratic_in_compute() -> None:
    def at(n: int) -> Estimate:  # compute 2N + 3N^2, memory 5 + 7N, bytes 11N
        return Estimate(32, 2 * n + 3 * n**2, 2 * n + 3 * n**2, (11 * n, 11 * n), 11 * n, 5 + 7 * n, 5 + 7 * n, 1, 2)

    assert extrapolate((10, at(10)), (20, at(20)), 50) == pytest.approx(at(50))


def test_command_writes_the_report(tmp_path) -> None:
    main(["--model", "tiny", "--sp", "2", "--seq-lens", "32", "--steps", "1", "--options", "plain", "--output",
          str(tmp_path / "emulate.md"), "--gpu-memory-gib", "80"])  # fmt: skip
    report = (tmp_path / "emulate.md").read_text()
    assert "| plain | 32 | 16 |" in report and "3.7M tokens on 8 H100" in report
