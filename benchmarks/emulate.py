"""Rank 0 of a multi-GPU Ulysses step, emulated on one device: its memory, its compute, its all-to-all bytes.

The lent machines have one GPU; the runs that matter have 8. This runs rank 0's share of an ``sp``-rank step of a
Llama-shaped model on one device, through the package's own path (``apply_ulysses_attention`` with the strategy's
head chunks, ``apply_memory_options``, :class:`~lightning_ulysses.UlyssesLossMixin`'s ``forward_causal_lm_loss``),
over the process grid ``UlyssesStrategy`` builds (``SequenceParallelGroups.create``: ``build_mesh``'s ``DeviceMesh``)
on a world of :class:`EmulatedPeers`: a process group of ``sp`` ranks of which only rank 0 exists, the default group
of the run (backend ``"emulated"``). Its collectives complete locally with tensors of the real shapes, so rank 0
holds ``N / sp`` tokens of every head before each attention and all ``N`` tokens of ``H / sp`` heads inside it,
exactly as in the real run::

    python -m benchmarks.emulate --model 8b --sp 8 --seq-lens 262144 524288 --extrapolate-to 3700000 --options alst all

What the peers would have sent is not there: an all-to-all hands rank 0 its own blocks back (the same shapes and
bytes; the whole sequence it attends over is its own shard repeated ``sp`` times), an all-gather returns the shards of
the batch's own position ids (so the documents, and the attention's work, are the real run's) or else ``sp`` copies of
rank 0's tensor, a sum over the group is ``sp`` times rank 0's value. Values are therefore not the real run's and the
loss is no check of anything; shapes, bytes, kernels, memory and compute are.

Measured, per model depth (``--layers``, two depths give the per-layer slope): the step's wall time (forward +
backward, no optimizer step; collectives are local copies), the peak memory above the resident weights and their
preallocated gradients, and the bytes of every all-to-all that would leave the device (``(sp - 1) / sp`` of each send
buffer; the same received). Derived: per layer (the slope between the depths) and for the full depth of the model.

Modelled, not measured (stated in the report):

* communication time: the off-device bytes of a layer over ``--link-gbps`` per direction (NVLink 4 on H100/H200:
  450 GB/s each way), the step as compute plus that (no overlap) and as the larger of the two (full overlap);
* ZeRO-3 over ``--world`` ranks, analytically: ``--state-bytes-per-param`` of every parameter sharded over the world
  (16: bf16 weight and gradient, fp32 master weight and Adam's two moments; 4 with the optimizer on the CPU; DeepSpeed's
  fp32 gradient copy for the optimizer would add 4) plus the unsharded working set: the gathered bf16 weights of the
  largest module and of one prefetched layer, and one reduce bucket of Lightning's default 2e8 elements. A module's
  whole gradient before its reduce-scatter is not added: the emulated step makes it too (its peak counts it).

Not measured at all: contention and overlap of real collectives, NCCL's own buffers and streams, allocator
fragmentation across a long run (the CUDA peak *reserved* is reported next to the allocated one), the optimizer step,
DeepSpeed's parameter gathering latency, and any rank but 0 (every rank holds ``N / sp`` tokens outside attention and
all ``N`` tokens of ``H / sp`` heads inside it: the same work). See ``docs/benchmarks/emulate.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future
from torch.nn.attention import sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.gpu_long_context import MODEL_SIZES, SDPA_BACKENDS, llama_config
from benchmarks.measure import PeakMemory, SavedForBackward, publish
from lightning_ulysses import UlyssesLossMixin
from lightning_ulysses.attention import resolve_attn_implementation
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf import apply_ulysses_attention
from lightning_ulysses.loss import LossContext
from lightning_ulysses.memory import MemoryOptions, apply_memory_options
from lightning_ulysses.sharding import prepare_batch, shard_batch
from lightning_ulysses.topology import SequenceParallelTopology

BACKEND = "emulated"
GiB = 2**30

# the memory options of UlyssesStrategy, by name ("alst": ALST's set; "all": ours, head chunks included)
_ALST: dict[str, Any] = dict(tiled_mlp=True, tiled_loss=True, activation_checkpointing=True, offload_activations=True)
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "checkpointing": dict(activation_checkpointing=True),
    "alst": _ALST,
    "all": dict(_ALST, fused_norms=True, head_chunks="auto"),
}

# ALST's published figure, printed beside the estimate (Arctic Long Sequence Training, arXiv:2506.13996)
ALST_8_H100 = "ALST (arXiv:2506.13996): Llama-3.1-8B at 3.7M tokens on 8 H100 (ZeRO-3, its memory options)"


# ----------------------------------------------------------------------------------------------
# the process group
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AllToAll:
    """One all-to-all of rank 0: its send buffer's shape and bytes, the bytes that leave the device (the blocks for
    the other ranks; the same count arrives), and whether it ran inside the backward (recomputation included)."""

    shape: tuple[int, ...]
    nbytes: int
    off_device: int
    backward: bool


def _done(result: Any) -> dist.Work:
    future: Future[Any] = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class EmulatedPeers(dist.ProcessGroup):
    """Rank 0 of ``size`` ranks, the others absent; every collective completes at once, locally:

    * all-to-all: the send buffer comes back (each block where the peer's would be; shapes and bytes exact), recorded
      in :attr:`all_to_alls`;
    * all-gather: the shards of a tensor given to :meth:`hold` when the input is its rank-0 shard (the batch's
      position ids: the documents are the real run's), else ``size`` copies of the input;
    * all-reduce: a sum is ``size`` times the input (the peers mirror rank 0), a max, min or average the input;
    * broadcast and barrier: nothing (rank 0 is the source).

    It keeps the name and description ``init_process_group`` / ``new_group`` give it: a ``ProcessGroup`` keeps them in
    its backends, and a Python one has none, so without these overrides ``group_name`` raises and no ``DeviceMesh``
    can be built over it.
    """

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.world = size
        self.all_to_alls: list[AllToAll] = []
        self._held: list[tuple[Tensor, list[Tensor]]] = []
        self._name = ""
        self._description = ""

    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        if not self._name:
            raise RuntimeError("ProcessGroup name not set")
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._description

    def setGroupDesc(self, description: str) -> None:
        self._description = description

    def hold(self, whole: Tensor, dim: int = 1) -> None:
        """Let all-gathers of ``whole``'s rank-0 shard (``size`` equal parts along ``dim``) return all its shards."""
        shards = list(whole.tensor_split(self.world, dim=dim))
        self._held.append((shards[0], shards))

    def alltoall_base(self, output: Tensor, input: Tensor, *args: Any) -> dist.Work:
        nbytes = input.numel() * input.element_size()
        backward = torch._C._current_autograd_node() is not None
        self.all_to_alls.append(AllToAll(tuple(input.shape), nbytes, nbytes * (self.world - 1) // self.world, backward))
        output.copy_(input)
        return _done([output])

    def allgather(self, outputs: list[list[Tensor]], inputs: list[Tensor], *args: Any) -> dist.Work:
        (source,) = inputs
        shards = next((s for first, s in self._held if _same(first, source)), [source] * self.world)
        for out, shard in zip(outputs[0], shards, strict=True):
            out.copy_(shard)
        return _done(outputs)

    def allreduce(self, tensors: list[Tensor], options: Any) -> dist.Work:
        if options.reduceOp == dist.ReduceOp.SUM:
            for tensor in tensors:
                tensor.mul_(self.world)
        return _done(tensors)

    def broadcast(self, tensors: list[Tensor], *args: Any) -> dist.Work:
        return _done(tensors)

    def barrier(self, *args: Any) -> dist.Work:
        return _done(None)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.to(b.device), b)


@contextmanager
def emulated_world(size: int, device_type: str = "cpu") -> Iterator[SequenceParallelGroups]:
    """Inside the block, the default process group is :class:`EmulatedPeers` of ``size`` ranks (this process: 0), and
    what it yields is the process grid ``UlyssesStrategy`` builds over it for plain Ulysses at ``sp = size``
    (:meth:`SequenceParallelGroups.create`: ``build_mesh``'s ``DeviceMesh`` over ``device_type``), every group of it
    :class:`EmulatedPeers` (the ``dp`` and ``ring`` axes of one rank; the SP group, :func:`peers_of`, of ``size``)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(
            BACKEND, lambda store, rank, size, timeout: EmulatedPeers(rank, size), devices=["cpu", "cuda"]
        )
    if dist.is_initialized():
        raise RuntimeError("benchmarks.emulate runs in a process without a process group of its own.")
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=size)
    try:
        yield SequenceParallelGroups.create(SequenceParallelTopology(size, size, 0), device_type)
    finally:
        dist.destroy_process_group()


def peers_of(groups: SequenceParallelGroups) -> EmulatedPeers:
    """The emulated SP group of :func:`emulated_world`'s ``groups``: what its all-to-alls recorded, what it holds."""
    peers = groups.sp
    if not isinstance(peers, EmulatedPeers):
        raise TypeError(f"{groups} is not the process grid of emulated_world.")
    return peers


# ----------------------------------------------------------------------------------------------
# one emulated step
# ----------------------------------------------------------------------------------------------
class _RankLoss(UlyssesLossMixin):
    """The mixin's loss path with the context UlyssesStrategy would publish for rank 0 (no Trainer)."""

    def __init__(self, context: LossContext) -> None:
        self._trainer = SimpleNamespace(strategy=SimpleNamespace(loss_context=context))  # type: ignore[assignment]


@dataclass
class StepMeasurement:
    """One depth of the model at one length: medians over the timed steps, and what one step moved."""

    layers: int
    step_time: float  # s
    peak_bytes: int  # allocated above the weights and gradients
    peak_reserved_bytes: int  # CUDA allocator's reserve above the same baseline (0 on CPU)
    saved_bytes: int  # what autograd saved for the backward in the forward (benchmarks.measure.SavedForBackward)
    all_to_alls: list[AllToAll] = field(repr=False)
    layer_inputs: list[tuple[int, ...]] = field(repr=False)  # shapes the decoder layers received

    @property
    def off_device_bytes(self) -> tuple[int, int]:
        """``(forward, backward)`` bytes rank 0 sends off the device per step (the same arrive), recomputation of
        checkpointed layers counted with the backward."""
        forward = sum(a.off_device for a in self.all_to_alls if not a.backward)
        return forward, sum(a.off_device for a in self.all_to_alls) - forward


def model_config(model: str, layers: int, seq_len: int) -> LlamaConfig:
    """``benchmarks.gpu_long_context``'s Llama ``model`` with ``layers`` decoder layers."""
    config = llama_config(model, seq_len)
    config.num_hidden_layers = layers
    return config


def patched_rank(
    groups: SequenceParallelGroups,
    config: LlamaConfig,
    option: str,
    device: torch.device,
    dtype: torch.dtype,
    core: str,
) -> tuple[LlamaForCausalLM, UlyssesLossMixin]:
    """``config`` built on ``device`` and patched over the process grid ``groups`` as UlyssesStrategy patches it for
    ``option`` (the set-up check included), and the loss path with the context the strategy publishes
    (:meth:`forward_causal_lm_loss` of what it returns runs the step's forward)."""
    sp = groups.topology.sp_size
    kwargs = dict(OPTIONS[option])
    head_chunks = kwargs.pop("head_chunks", None)
    memory = MemoryOptions(**kwargs)
    with device:
        model = LlamaForCausalLM(config).to(dtype)
    apply_ulysses_attention(model, groups, core, head_chunks=head_chunks)
    apply_memory_options(model, memory)
    context = LossContext(
        groups,
        normalization="sp_group",
        gradient_scale=float(sp),
        tiled_loss=memory.tiled_loss,
        batch=None,
        accumulate_grad_batches=1,
        record_exact_reduction=lambda: None,
    )
    loss = _RankLoss(context)
    return model, loss


def run_rank0(
    groups: SequenceParallelGroups,
    config: LlamaConfig,
    seq_len: int,
    option: str,
    device: torch.device,
    dtype: torch.dtype,
    steps: int,
    core: str = "sdpa",
) -> StepMeasurement:
    """:func:`patched_rank` over :func:`emulated_world`'s ``groups``, then ``1 + steps`` forward + backward steps of
    rank 0's shard of one random ``seq_len`` sequence (the first not timed)."""
    peers = peers_of(groups)
    sp = peers.world
    model, loss = patched_rank(groups, config, option, device, dtype, core)
    for parameter in model.parameters():  # resident, as ZeRO's gradient partitions are: not part of the peak
        parameter.grad = torch.zeros_like(parameter)

    whole = prepare_batch({"input_ids": torch.randint(0, config.vocab_size, (1, seq_len))}, sp)
    peers.hold(whole["position_ids"])
    batch = {k: v.to(device) for k, v in shard_batch(whole, 0, sp).items()}
    layer_inputs: list[tuple[int, ...]] = []

    def record_input(module: nn.Module, args: tuple[Any, ...]) -> None:
        # the forward's calls only: transformers 5.17 recomputes a checkpointed layer through its hooks, 5.24 does not
        if torch._C._current_autograd_node() is None:
            layer_inputs.append(tuple(args[0].shape))

    hooks = [layer.register_forward_pre_hook(record_input) for layer in model.model.layers]
    peak = PeakMemory(device)
    times, peaks, reserved = [], [], []
    saved = SavedForBackward()
    for step in range(1 + steps):
        layer_inputs.clear()
        peers.all_to_alls.clear()
        peak.reset()
        start = time.perf_counter()
        with saved if step == 0 else contextlib.nullcontext():  # the warm-up step: its hooks are not timed
            value = loss.forward_causal_lm_loss(model, batch)
        value.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            reserved.append(torch.cuda.max_memory_reserved(device) - peak.baseline)
        if step:
            times.append(time.perf_counter() - start)
        peaks.append(peak.peak())
    for hook in hooks:
        hook.remove()
    measurement = StepMeasurement(
        config.num_hidden_layers,
        statistics.median(times) if times else float("nan"),
        max(peaks),
        max(reserved, default=0),
        saved.bytes,
        list(peers.all_to_alls),
        list(layer_inputs),
    )
    del model, loss, value
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measurement


# ----------------------------------------------------------------------------------------------
# the models: per layer, ZeRO-3, the link
# ----------------------------------------------------------------------------------------------
def parameter_counts(config: LlamaConfig) -> dict[str, int]:
    """``total``, ``layer`` (one decoder layer) and ``largest`` (the largest module ZeRO-3 gathers whole: the embedding
    or the LM head), counted on the meta device."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {
        "total": sum(p.numel() for p in model.parameters()),
        "layer": sum(p.numel() for p in model.model.layers[0].parameters()),
        "largest": max(model.get_input_embeddings().weight.numel(), model.get_output_embeddings().weight.numel()),
    }


REDUCE_BUCKET_ELEMENTS = 200_000_000  # Lightning's DeepSpeedStrategy default (reduce_bucket_size)


def zero3_bytes(counts: dict[str, int], world: int, state_bytes_per_param: float) -> tuple[float, float]:
    """``(sharded state, unsharded working set)`` per rank under ZeRO-3 over ``world`` ranks, analytically: every
    parameter's ``state_bytes_per_param`` over ``world``; the gathered bf16 weights of the largest module and of one
    prefetched decoder layer, one bf16 reduce bucket (the emulated step holds every weight already, and makes each
    module's whole gradient as ZeRO-3 does before reducing it: neither is in its peak above the resident weights)."""
    state = counts["total"] * state_bytes_per_param / world
    working = 2 * (counts["largest"] + counts["layer"]) + 2 * REDUCE_BUCKET_ELEMENTS
    return state, working


@dataclass(frozen=True)
class Estimate:
    """Rank 0's full-depth step at one length (``layers`` decoder layers)."""

    layers: int
    compute_per_layer: float  # s
    compute: float  # s, full depth
    off_device_per_layer: tuple[float, float]  # bytes sent per layer (forward, backward); as many are received
    comm: float  # s, full depth at the link's rate, one direction
    activation_peak_per_layer: float  # bytes
    activation_peak: float  # bytes, full depth
    zero3_state: float
    zero3_working: float
    reserve: float = 0.0  # bytes the CUDA allocator held beyond the allocated peak in the deeper measured run

    @property
    def memory(self) -> float:
        return self.activation_peak + self.zero3_state + self.zero3_working


def estimate(
    low: StepMeasurement, high: StepMeasurement, layers: int, link_gbps: float, zero3: tuple[float, float]
) -> Estimate:
    """Per layer: the slope between ``low`` and ``high`` (the same model at two depths); full depth ``layers``:
    ``high`` plus the slope times the layers it lacks. The all-to-alls are the attention layers' alone, so the bytes
    per layer are ``high``'s over its layers."""
    depth = high.layers - low.layers
    compute_slope = (high.step_time - low.step_time) / depth
    memory_slope = (high.peak_bytes - low.peak_bytes) / depth
    forward, backward = (b / high.layers for b in high.off_device_bytes)
    missing = layers - high.layers
    return Estimate(
        layers,
        compute_slope,
        high.step_time + missing * compute_slope,
        (forward, backward),
        layers * (forward + backward) / (link_gbps * 1e9),
        memory_slope,
        high.peak_bytes + missing * memory_slope,
        *zero3,
        max(0, high.peak_reserved_bytes - high.peak_bytes),
    )


def extrapolate(short: tuple[int, Estimate], long: tuple[int, Estimate], seq_len: int) -> Estimate:
    """The estimate at ``seq_len`` from those at two measured lengths: memory and bytes linear in ``N`` (every
    activation is, with fused attention kernels, and so are the all-to-alls), compute ``a N + b N^2`` (attention
    quadratic, everything else linear)."""
    (n1, e1), (n2, e2) = short, long

    def linear(y1: float, y2: float) -> float:
        return y1 + (y2 - y1) * (seq_len - n1) / (n2 - n1)

    def quadratic(y1: float, y2: float) -> float:
        b = (y2 / n2 - y1 / n1) / (n2 - n1)
        return (y1 / n1 - b * n1) * seq_len + b * seq_len**2

    scale = seq_len / n2
    return Estimate(
        e2.layers,
        quadratic(e1.compute_per_layer, e2.compute_per_layer),
        quadratic(e1.compute, e2.compute),
        (e2.off_device_per_layer[0] * scale, e2.off_device_per_layer[1] * scale),
        e2.comm * scale,
        linear(e1.activation_peak_per_layer, e2.activation_peak_per_layer),
        linear(e1.activation_peak, e2.activation_peak),
        e2.zero3_state,
        e2.zero3_working,
        e2.reserve,
    )


# ----------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODEL_SIZES), default="8b")
    parser.add_argument("--sp", type=int, default=8, help="ranks of the emulated SP group")
    parser.add_argument("--world", type=int, default=0, help="ranks ZeRO-3 shards over (0: --sp)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072])
    parser.add_argument("--extrapolate-to", type=int, nargs="*", default=[], help="from the two longest --seq-lens")
    parser.add_argument("--layers", type=int, nargs=2, default=[1, 2], help="the two depths measured")
    parser.add_argument("--options", choices=list(OPTIONS), nargs="+", default=["all"])
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step (0: memory only)")
    parser.add_argument("--attn-implementation", default="auto")
    parser.add_argument("--sdpa-backend", choices=list(SDPA_BACKENDS), default="any", help="flash: no fallback")
    parser.add_argument("--link-gbps", type=float, default=450.0, help="per direction; NVLink 4 (H100/H200): 450")
    parser.add_argument("--state-bytes-per-param", type=float, default=16.0)
    parser.add_argument("--gpu-memory-gib", type=float, default=0.0, help="0: the device's own")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if not 0 < args.layers[0] < args.layers[1]:
        parser.error("--layers takes two depths, the first smaller.")
    if args.extrapolate_to and len(set(args.seq_lens)) < 2:
        parser.error("--extrapolate-to needs two --seq-lens to extrapolate from.")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure every option at every length, estimate the full depth, extrapolate where asked; publish the report."""
    args = parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if on_gpu:
        torch.cuda.set_device(device)
    core = resolve_attn_implementation(args.attn_implementation, device.type, dtype)
    full = llama_config(args.model, max(args.seq_lens))
    zero3 = zero3_bytes(parameter_counts(full), args.world or args.sp, args.state_bytes_per_param)
    gpu_memory = args.gpu_memory_gib * GiB or (torch.cuda.get_device_properties(device).total_memory if on_gpu else 0)
    device_name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    rows: list[dict[str, Any]] = []

    def report() -> str:
        return render(args, rows, device_name, gpu_memory, dtype, core)

    with emulated_world(args.sp, device.type) as groups, sdpa_kernel(SDPA_BACKENDS[args.sdpa_backend]):
        for option in args.options:
            measured: list[tuple[int, Estimate]] = []
            for seq_len in sorted(set(args.seq_lens)):
                try:
                    low, high = (
                        run_rank0(
                            groups,
                            model_config(args.model, d, seq_len),
                            seq_len,
                            option,
                            device,
                            dtype,
                            args.steps,
                            core,
                        )
                        for d in args.layers
                    )
                except torch.cuda.OutOfMemoryError:
                    rows.append({"option": option, "seq_len": seq_len, "estimate": None, "measured": True})
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                measured.append((seq_len, estimate(low, high, full.num_hidden_layers, args.link_gbps, zero3)))
                rows.append({"option": option, "seq_len": seq_len, "estimate": measured[-1][1], "measured": True})
                print(f"{option} N={seq_len}: {measured[-1][1]}", flush=True)
                if args.output:  # as results appear: a run stopped at its time limit keeps what it measured
                    args.output.parent.mkdir(parents=True, exist_ok=True)
                    args.output.write_text(report())
            for seq_len in args.extrapolate_to if len(measured) >= 2 else []:
                result = extrapolate(measured[-2], measured[-1], seq_len)
                rows.append({"option": option, "seq_len": seq_len, "estimate": result, "measured": False})
    publish(report(), args.output)
    return rows


def render(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    device_name: str,
    gpu_memory: float,
    dtype: torch.dtype,
    core: str,
) -> str:
    world = args.world or args.sp
    command = " ".join(_command_words(args))
    lines = [
        f"# Rank 0 of sp={args.sp} emulated on one {device_name}: Llama {args.model}",
        "",
        f"`python -m benchmarks.emulate {command}` ({time.strftime('%Y-%m-%d', time.gmtime())}, torch "
        f"{torch.__version__}, {dtype}, attention kernel {core})",
        "",
        f"Measured at depths {args.layers[0]} and {args.layers[1]} (step times: median of {args.steps} after one "
        "warm-up); per layer is their slope, the full depth the deeper run plus the slope. Activation peak: above the "
        "resident weights and gradients of the emulated model, which ZeRO-3 replaces by its sharded state. "
        f"Link: {args.link_gbps:g} GB/s per direction, rank 0's off-device bytes (as many arrive). ZeRO-3 over "
        f"{world} ranks, analytic: {args.state_bytes_per_param:g} B/param sharded, plus the unsharded working set. "
        "Rows with `~`: extrapolated from the two longest measured lengths (memory linear in N, compute aN + bN^2).",
        "",
        "| option | N | tokens/rank | per layer: compute (ms) | per layer: activation peak (GiB) | per layer: sent "
        "fwd / bwd (MiB) | per layer: link (ms) | step: compute (s) | step: link (s) | step: serial / overlapped (s) "
        f"| memory (GiB): activations + ZeRO-3 state + working | fits {gpu_memory / GiB:.0f} GiB | allocator reserve "
        "beyond the peak (GiB, measured) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        e: Estimate | None = row["estimate"]
        if e is None:
            lines.append(f"| {row['option']} | {row['seq_len']:,} | {row['seq_len'] // args.sp:,} | out of memory |")
            continue
        link = sum(e.off_device_per_layer) / (args.link_gbps * 1e9)
        fits = "" if not gpu_memory else "yes" if e.memory <= gpu_memory else "no"
        length = f"{'' if row['measured'] else '~'}{row['seq_len']:,}"
        lines.append(
            f"| {row['option']} | {length} | {row['seq_len'] // args.sp:,} | {e.compute_per_layer * 1e3:.1f} "
            f"| {e.activation_peak_per_layer / GiB:.3f} | {e.off_device_per_layer[0] / 2**20:.1f} / "
            f"{e.off_device_per_layer[1] / 2**20:.1f} | {link * 1e3:.1f} | {e.compute:.2f} | {e.comm:.2f} | "
            f"{e.compute + e.comm:.2f} / {max(e.compute, e.comm):.2f} | {e.activation_peak / GiB:.1f} + "
            f"{e.zero3_state / GiB:.1f} + {e.zero3_working / GiB:.1f} = {e.memory / GiB:.1f} | {fits} "
            f"| {e.reserve / GiB:.1f} |"
        )
    lines += ["", f"Beside it: {ALST_8_H100}.", ""]
    return "\n".join(lines)


def _command_words(args: argparse.Namespace) -> list[str]:
    """The arguments that shape the result, as a command line (not where it ran or where it was written)."""
    words = []
    for name, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        if name not in ("output", "device") and values:
            words += [f"--{name.replace('_', '-')}", *map(str, values)]
    return words


if __name__ == "__main__":
    main()
