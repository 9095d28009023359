"""Head layout: any number of query and key/value heads over any number of SP ranks.

The all-to-all hands every rank the same number of head slots (gloo refuses uneven splits), so a
head count that does not divide by ``sp_size`` is laid out on ``sp_size * heads_per_rank`` query
slots and ``sp_size * kv_heads_per_rank`` key/value slots:

* a key/value slot holds one K/V head and ``group = heads_per_rank / kv_heads_per_rank`` query slots,
  each either one of that K/V head's query heads or *inert* (a copy of a real query head whose output
  is dropped, so it receives no gradient). A K/V group larger than ``group`` is spread over several
  slots, each with its own copy of the K/V head: a query head always sits next to its own K/V head, so
  the local attention is ordinary GQA (query slot ``i`` reads K/V slot ``i // group``).
* rank ``r`` owns query slots ``[r * heads_per_rank, (r + 1) * heads_per_rank)`` and the matching
  K/V slots.

``heads_per_rank = ceil(heads / sp_size)`` is the least any layout can give; among the layouts with
it, the one with the fewest K/V slots is chosen. When the heads divide (the classic Ulysses cases,
``kv_heads % sp_size == 0`` or ``sp_size % kv_heads == 0``) the layout is the classic one.

Example, 6 heads, 1 K/V head (MQA), ``sp_size=4``: 2 query slots and 1 K/V slot per rank::

    rank        0          1          2          3
    K/V slot    kv0        kv0        kv0        kv0 (inert)
    query slots q0 q1      q2 q3      q4 q5      q5 q5 (inert)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_ulysses.topology import divisors


def check_heads(num_heads: int, num_kv_heads: int) -> None:
    """Refuse the only head counts that cannot work: query heads that do not form equal K/V groups."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}: grouped-query attention "
            "needs every key/value head to serve the same number of query heads."
        )


@dataclass(frozen=True)
class HeadLayout:
    """Where each head travels in the all-to-all (see the module docstring).

    ``query_slots[s]`` / ``kv_slots[s]`` are the source heads of slot ``s`` (``sp_size * heads_per_rank``
    and ``sp_size * kv_heads_per_rank`` of them); ``output_slots[i]`` is the slot whose output is query
    head ``i``.
    """

    num_heads: int
    num_kv_heads: int
    sp_size: int
    heads_per_rank: int
    kv_heads_per_rank: int
    query_slots: tuple[int, ...]
    kv_slots: tuple[int, ...]
    output_slots: tuple[int, ...]

    @property
    def overhead(self) -> float:
        """Query slots per real query head: the factor on attention compute and on the query/output all-to-alls."""
        return len(self.query_slots) / self.num_heads

    @property
    def kv_overhead(self) -> float:
        """Key/value slots per K/V head the classic layout would send (replication included)."""
        return len(self.kv_slots) / max(self.num_kv_heads, self.sp_size)


@functools.cache
def plan_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> HeadLayout:
    """The head layout of ``num_heads`` query and ``num_kv_heads`` key/value heads over ``sp_size`` ranks."""
    check_heads(num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    heads_per_rank = -(-num_heads // sp_size)
    # query slots per K/V slot: the largest that fits every K/V group into sp_size * kv_heads_per_rank slots
    # (1 always fits: kv_heads_per_rank = heads_per_rank and one slot per query head)
    slot_group = next(
        m
        for m in reversed(divisors(heads_per_rank))
        if sp_size * (heads_per_rank // m) >= num_kv_heads * -(-group // m)
    )
    kv_heads_per_rank = heads_per_rank // slot_group

    query_slots: list[int] = []
    kv_slots: list[int] = []
    for kv_head in range(num_kv_heads):
        heads = list(range(kv_head * group, (kv_head + 1) * group))
        for first in range(0, group, slot_group):
            chunk = heads[first : first + slot_group]
            query_slots += chunk + [chunk[-1]] * (slot_group - len(chunk))
            kv_slots.append(kv_head)
    num_kv_slots = sp_size * kv_heads_per_rank
    kv_slots += [kv_slots[-1]] * (num_kv_slots - len(kv_slots))
    query_slots += [query_slots[-1]] * (num_kv_slots * slot_group - len(query_slots))
    first_slot: dict[int, int] = {}  # a head's first slot (list.index per head is quadratic: token mixers
    for slot, head in enumerate(query_slots):  # shard thousands of channels as heads)
        first_slot.setdefault(head, slot)
    output_slots = [first_slot[head] for head in range(num_heads)]
    return HeadLayout(
        num_heads,
        num_kv_heads,
        sp_size,
        heads_per_rank,
        kv_heads_per_rank,
        tuple(query_slots),
        tuple(kv_slots),
        tuple(output_slots),
    )


def select_heads(x: Tensor, slots: tuple[int, ...], dim: int = 2) -> Tensor:
    """``[B, n, H, D] -> [B, n, len(slots), D]``: head ``slots[s]`` at position ``s`` (a no-op for ``range(H)``);
    ``dim`` names another head axis (``0`` for a per-head ``[H]`` vector)."""
    if slots == tuple(range(x.shape[dim])):
        return x
    return x.index_select(dim, _index(slots, x.device))


@functools.lru_cache(maxsize=64)
def _index(slots: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor(slots, dtype=torch.long, device=device)
