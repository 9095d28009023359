"""The ranks of an SP group hold the same rows: their loaders' samplers and workers, and a check of every batch.

The ``sp_size`` ranks of an SP group split each sequence between them, so they must load the same rows in the same
order; ranks that load different rows would train on a blend of different sequences without an error. Lightning's
own distributed sampler runs over the DP ranks (``UlyssesStrategy.distributed_sampler_kwargs``), but a loader may
bring its own:

* a ``DistributedSampler(dataset)`` built in a ``*_dataloader`` hook over the whole world (as code written for DDP
  does), which Lightning keeps. :func:`sampler_over_dp_ranks` replaces it by the same sampler over the DP ranks
  (``num_replicas=dp_size, rank=dp_rank``, same dataset, shuffle, seed, ``drop_last`` and epoch) and says so;
* anything else that depends on the global rank (a sampler of its own, an ``IterableDataset`` sharded or randomly
  cropped by rank, augmentation seeded by rank), or a dataset that each process builds differently (random data
  drawn without a seed), which nothing can repair. :func:`check_sp_group_agreement` refuses it at its first batch.

Worker seeding. With ``seed_everything(workers=True)`` Lightning seeds every loader worker from the worker's torch
seed, its id and the global rank (``pl_worker_init_function``), so that DDP ranks draw different random
augmentations. Under SP the ranks of a group must draw the same ones and DP groups different ones, so the strategy
gives the loader Lightning's function with the DP rank in place of the global rank (at ``sp_size=1`` exactly
Lightning's seeding), on the ``DataLoader`` itself, before wrapping it. The workers' torch seed is drawn from each
process's default generator, which ``seed_everything`` sets alike on every rank; were it to differ within an SP
group, the check below would stop the run.

The check runs on every batch of every stage (training, validation, test, prediction) with ``sp_size > 1``, in
``UlyssesStrategy.batch_to_device`` before the batch is cut into shards. It covers every leaf the batch carries,
nested dicts, lists, tuples and dataclasses walked: each tensor, of any dtype (floats by their bits, so one element
that differs in its last bit is found), with its key path, dtype and shape, and plain values (str, int, ...); images
augmented by rank are caught like rows sampled by rank. Its cost: a few elementwise kernels per tensor, one
all-gather over the SP group of a 2-number :meth:`BatchFingerprint.summary`, and one read of the gathered numbers on
the host (not inside any layer). On a mismatch, a second exchange finds the keys that differ, and every rank raises
the same error, naming the loader, the keys, the two common causes (rows picked by global rank; a dataset built
differently in each process) and their fixes.

Forked workers. On CPython releases before the fix of gh-112275 (3.10.15, 3.11.10; 3.12 never had it) a forked
child can hang before it runs a line, in ``PyOS_AfterFork_Child``, when another thread of the parent was creating or
ending a Python thread state at that instant; the ranks of a job run such threads (collectives, the strategy's
heartbeat), and a loader's workers are forked by default. This package's data modules start theirs from a fork
server there (:func:`worker_start_method`); for other loaders :func:`warn_on_forked_workers` says so once per loader.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DistributedSampler

from lightning_ulysses.attention.collectives import gather_from_ranks
from lightning_ulysses.engines import lightning as lightning_engine
from lightning_ulysses.topology import SequenceParallelTopology


def _int64(constant: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


_GOLDEN, _MIX1, _MIX2 = (_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def index_batch_sampler(loader: Any) -> Any:
    """The batch sampler that draws ``loader``'s indices (the one inside Lightning's index-recording wrapper when
    predicting); None for loaders without one."""
    return lightning_engine.inside_index_batch_sampler(getattr(loader, "batch_sampler", None))


def sampler_over_dp_ranks(loader: Any, topology: SequenceParallelTopology, loader_name: str) -> None:
    """Replace, in place, a plain ``DistributedSampler`` over the whole world (``num_replicas == world_size``, this
    rank's global rank) that ``loader``'s batch sampler draws from by the same sampler over the DP ranks."""
    batch_sampler = index_batch_sampler(loader)
    sampler = getattr(batch_sampler, "sampler", None)
    if (
        type(sampler) is not DistributedSampler  # a subclass may sample otherwise: the check judges it
        or topology.sp_size == 1
        or (sampler.num_replicas, sampler.rank) != (topology.world_size, topology.rank)
    ):
        return
    over_dp: DistributedSampler[Any] = DistributedSampler(
        sampler.dataset,
        num_replicas=topology.dp_size,
        rank=topology.dp_rank,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
        drop_last=sampler.drop_last,
    )
    over_dp.set_epoch(sampler.epoch)
    # the batch sampler's is read at every iteration and by len(); DataLoader.sampler cannot be reassigned and keeps
    # the old one, whose epoch Lightning sets along with this one's
    batch_sampler.sampler = over_dp
    rank_zero_info(
        f"lightning-ulysses: the {loader_name}'s DistributedSampler runs over all {topology.world_size} ranks, which "
        f"would give the {topology.sp_size} ranks of each SP group different rows; it now runs over the "
        f"{topology.dp_size} DP ranks (num_replicas=dp_size, rank=dp_rank; same shuffle, seed and drop_last)."
    )


FORK_DEADLOCK_FIXED_IN = {(3, 10): 15, (3, 11): 10}
"""CPython ``(major, minor) -> patch release`` that fixed gh-112275 (a child deadlocked on the interpreter's
thread-state lock after ``fork``); every 3.12 and later is free of it."""


def fork_can_deadlock(version: tuple[int, int, int] | None = None, implementation: str | None = None) -> bool:
    """Whether a forked child of a multi-threaded process can hang in this interpreter's after-fork code (gh-112275).
    ``version`` and ``implementation`` default to the running interpreter's."""
    major, minor, patch = version or tuple(sys.version_info[:3])
    if (implementation or sys.implementation.name) != "cpython":
        return False
    return patch < FORK_DEADLOCK_FIXED_IN.get((major, minor), 0)


def worker_start_method(num_workers: int) -> str | None:
    """The ``multiprocessing_context`` of this package's data loaders: ``"forkserver"`` where a forked worker can hang
    (:func:`fork_can_deadlock`; the workers then start from a clean server process, so the dataset and the collate
    function travel pickled), else None (the platform's default)."""
    forkserver = "forkserver" in multiprocessing.get_all_start_methods()
    return "forkserver" if num_workers > 0 and forkserver and fork_can_deadlock() else None


def warn_on_forked_workers(loader: Any, loader_name: str) -> None:
    """Warn (rank zero, once per loader) when ``loader`` forks worker processes on an interpreter where a forked
    child can hang (:func:`fork_can_deadlock`), naming the remedies."""
    workers = getattr(loader, "num_workers", 0)
    if workers == 0 or not fork_can_deadlock():
        return
    context = getattr(loader, "multiprocessing_context", None)
    if context is not None:
        start_method = context.get_start_method()
    else:  # the platform's default; get_start_method() without allow_none would fix it for the process
        start_method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if start_method != "fork":
        return
    rank_zero_warn(
        f"lightning-ulysses: the {loader_name} forks {workers} worker processes, and on this Python "
        f"({sys.version.split()[0]}) a forked child can hang before its first line while another thread of the rank "
        "(the collectives', the strategy's heartbeat) starts or ends (CPython gh-112275; rare, and then the run "
        "waits forever for a batch). Use Python 3.11.10, 3.10.15 or 3.12 and later, or give the DataLoader "
        "multiprocessing_context='forkserver' (its dataset and collate function must then pickle), or num_workers=0."
    )


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 values (torch shifts arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 values (wrapping arithmetic): a bijection that scatters nearby inputs."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
HASHED_AT_ONCE = 1 << 22
"""Elements of a tensor hashed per step of :func:`tensor_fingerprint`: bounds its int64 temporaries (a few of 32 MiB)
whatever the batch holds (a video's pixels)."""


def _as_integers(tensor: Tensor) -> Tensor:
    """``tensor``'s elements as integers without a copy: integers and booleans as they are, floating-point (and
    complex) elements by their bits, so two tensors agree only where every element is bit-identical."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.is_floating_point():
        tensor = tensor.view(_INT_OF_WIDTH[tensor.element_size()])  # same width: any layout views
    return tensor


def tensor_fingerprint(tensor: Tensor) -> Tensor:
    """A 0-d int64 hash of ``tensor``'s values (by their bits, whatever the dtype), their positions and its shape,
    without a host sync.

    Each element is hashed with its flat position and the hashes are summed (addition modulo 2**64 does not depend
    on the order of a parallel reduction, nor on how the elements are split into steps), so rows that hold the same
    tokens in another order, or shifted by one column, differ; a plain sum of the values would not tell them apart.
    """
    values = _as_integers(tensor.detach()).reshape(-1)
    fingerprint = torch.zeros((), dtype=torch.long, device=values.device)
    for start in range(0, values.numel(), HASHED_AT_ONCE):
        part = values[start : start + HASHED_AT_ONCE].long()
        positions = torch.arange(start, start + part.numel(), device=values.device)
        fingerprint = fingerprint + _mix(part * _GOLDEN + positions).sum()
    for size in tensor.shape:
        fingerprint = _mix(fingerprint + size)
    return fingerprint


def batch_leaves(batch: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of ``batch`` with its key path (``"pixel_values"``, ``"images.0.crop"``; ``"batch"`` for a batch
    that is a leaf itself): mappings (in key order), lists, tuples and dataclasses are walked, anything else is a
    leaf."""
    if isinstance(batch, Mapping):
        entries: Any = sorted(batch.items(), key=lambda item: str(item[0]))
    elif isinstance(batch, (list, tuple)):
        entries = enumerate(batch)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        entries = ((field.name, getattr(batch, field.name)) for field in dataclasses.fields(batch))
    else:
        yield path or "batch", batch
        return
    for key, value in entries:
        yield from batch_leaves(value, f"{path}.{key}" if path else str(key))


def _describe(leaf: Any) -> str:
    """What the host knows of a leaf: a tensor's dtype and shape, a plain value itself, any other object's type."""
    if isinstance(leaf, Tensor):
        return f"tensor {leaf.dtype} {tuple(leaf.shape)}"
    if leaf is None or isinstance(leaf, (bool, int, float, complex, str, bytes)):
        return f"{type(leaf).__name__} {leaf!r}"
    return type(leaf).__qualname__


def _host_hash(text: str) -> int:
    """A 64-bit hash of ``text`` as an int64, the same in every process (``hash()`` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


@dataclasses.dataclass
class BatchFingerprint:
    """What :func:`check_sp_group_agreement` compares of one batch: every leaf's path and description (host), and
    every tensor leaf's :func:`tensor_fingerprint` (device)."""

    described: dict[str, str]
    """Path -> :func:`_describe` of every leaf, in :func:`batch_leaves` order."""
    tensors: dict[str, Tensor]
    """Path -> 0-d int64 :func:`tensor_fingerprint` of every tensor leaf."""

    def summary(self, device: torch.device) -> Tensor:
        """``[2]`` int64 on ``device``: a hash of the structure (paths, dtypes, shapes, plain values), then one of
        every tensor's values with its path."""
        structure = _host_hash(repr(list(self.described.items())))
        values = torch.zeros((), dtype=torch.long, device=device)
        for path, fingerprint in self.tensors.items():
            values = values + _mix(fingerprint + _host_hash(path))
        return torch.stack([torch.full_like(values, structure), values])


def batch_fingerprint(batch: Any, device: torch.device) -> BatchFingerprint:
    """The :class:`BatchFingerprint` of every leaf of ``batch`` (:func:`batch_leaves`), tensors hashed on ``device``
    (a few elementwise kernels per tensor, no host sync)."""
    leaves = list(batch_leaves(batch))
    return BatchFingerprint(
        {path: _describe(leaf) for path, leaf in leaves},
        {path: tensor_fingerprint(leaf.to(device)) for path, leaf in leaves if isinstance(leaf, Tensor)},
    )


def _differing_keys(fingerprint: BatchFingerprint, group: dist.ProcessGroup) -> list[str]:
    """The paths whose leaf differs somewhere in the SP ``group``, or that some of its ranks lack (a collective, run
    only once the summaries differ, so every rank of the group runs it)."""
    local = {
        path: (described, int(fingerprint.tensors[path]) if path in fingerprint.tensors else None)
        for path, described in fingerprint.described.items()
    }
    every_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every_rank, local, group=group)
    paths = list(dict.fromkeys(path for leaves in every_rank for path in leaves))
    return [path for path in paths if len({repr(leaves.get(path)) for leaves in every_rank}) > 1]


def check_sp_group_agreement(batch: Any, group: dist.ProcessGroup, device: torch.device, loader_name: str) -> None:
    """Raise on every rank of the SP ``group`` unless all of them hold the same ``batch``, every tensor, nested ones
    included, bit for bit (a collective: every rank of the group calls it for every batch; one all-gather of
    :meth:`BatchFingerprint.summary`, and a second exchange that names the keys only when they differ)."""
    fingerprint = batch_fingerprint(batch, device)
    summaries = torch.stack(gather_from_ranks(fingerprint.summary(device), group)).tolist()
    differing = [rank for rank, summary in enumerate(summaries) if summary != summaries[0]]
    if not differing:
        return
    keys = _differing_keys(fingerprint, group)
    raise ValueError(
        f"The {loader_name} gave the ranks of an SP group (global ranks {dist.get_process_group_ranks(group)}) "
        f"different batches: {', '.join(keys)} of SP rank(s) {differing} differ from SP rank 0's. The ranks of an "
        "SP group split each sequence between them and must load the same rows. Two causes are common. (1) The "
        "loader picks its rows by the global rank (a sampler of its own, an IterableDataset sharded or randomly "
        "cropped by rank, random augmentation seeded by rank). Pick them by the data-parallel rank instead: "
        "DistributedSampler(dataset, num_replicas=trainer.strategy.dp_size, rank=trainer.strategy.dp_rank), or "
        "shard an IterableDataset by those; or leave the sampler to Lightning: a DataLoader without a distributed "
        "sampler of its own and Trainer(use_distributed_sampler=True), the default. (2) The dataset is built "
        "differently in each process: random data made without a seed (at import, in __init__ or setup), each "
        "process drawing its own. Seed it (torch.Generator().manual_seed(...), or L.seed_everything(...) before "
        "building it), or build it once in prepare_data and read it from files in setup. Every rank stops here, "
        "before this batch runs."
    )
