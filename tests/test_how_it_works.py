"""docs/how-it-works.md says what the code does: the number of all-to-alls one attention layer runs, counted through
:func:`lightning_ulysses.attention.collectives.all_to_all` in a patched layer's forward and backward on 2 processes
(sp=2; a one-layer tiny Llama, so the model's count is the layer's)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_ulysses.attention import collectives
from lightning_ulysses.hf import apply_ulysses_attention
from tests.launch import REPO_ROOT, launch
from tests.tiny import VOCAB, tiny_llama

NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4}
TOKENS = 16


def stated_all_to_alls() -> int:
    """The count in the heading of the section on one layer's all-to-alls, which the backward mirrors."""
    text = (REPO_ROOT / "docs" / "how-it-works.md").read_text()
    heading = re.search(r"^## The (\w+) all-to-alls \(one attention layer", text, re.MULTILINE)
    assert heading is not None, "docs/how-it-works.md has no section on one layer's all-to-alls"
    assert "In backward, each all-to-all's gradient is the inverse all-to-all" in " ".join(text.split())
    return NUMBERS[heading.group(1)]


def all_to_all_worker(args: dict[str, Any]) -> dict[str, int]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_llama(num_hidden_layers=1)
    apply_ulysses_attention(model, group=init_device_mesh("cpu", (2,)), core="sdpa")
    ids = torch.randint(VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    shard = slice(rank * TOKENS // 2, (rank + 1) * TOKENS // 2)
    positions = torch.arange(TOKENS)[None, shard]
    calls: Counter[str] = Counter()
    phase = "forward"
    original = collectives.all_to_all

    def counted(*call_args: Any, **kwargs: Any) -> Any:
        calls[phase] += 1
        return original(*call_args, **kwargs)

    collectives.all_to_all = counted
    try:
        logits = model(input_ids=ids[:, shard], position_ids=positions).logits
        phase = "backward"
        logits.sum().backward()
    finally:
        collectives.all_to_all = original
    dist.destroy_process_group()
    return dict(calls)


@pytest.mark.distributed
def test_the_documented_all_to_all_count_is_the_counted_one() -> None:
    stated = stated_all_to_alls()
    for calls in launch("tests.test_how_it_works:all_to_all_worker", 2):
        assert calls == {"forward": stated, "backward": stated}, calls
