"""All-to-all bytes and activation memory of the head-sharded token mixers, per layer and token, measured and
compared with the formula.

One mixer layer per kernel family, at the dimensions of the family's default config (the flagship checkpoint's, as
transformers ships them), runs forward and backward on ``--tokens`` tokens split over ``--sp`` CPU processes
(gloo, fp32, batch 1) with :func:`~lightning_ulysses.hf.mixers.shard_token_mixers`:

* **all-to-all bytes**: every call of :func:`lightning_ulysses.attention.collectives.all_to_all` (both directions,
  forward and backward) is counted: the send buffer of one rank, the chunk it keeps included, divided by the tokens
  of its shard. The formula: each sharded stream sends ``slots * dim`` elements per token, where ``slots`` is the
  number of head (or group, or channel) slots over all ranks (:func:`~lightning_ulysses.heads.plan_heads`), into
  the kernel and out of it, and as much again in backward.
* **activation memory**: the bytes that autograd keeps for backward (``saved_tensors_hooks``, each storage once,
  the layer's weights and buffers not counted),
  per token of the rank's shard, sharded at ``--sp`` and on one process with the whole sequence: the sharded form
  keeps ``1/sp`` of it per rank (the ``gather`` fallback keeps all of it on every rank).
* **against attention**: a softmax-attention layer of the same family sends ``2 * (H + H_kv) * D`` elements per token
  (q, k, v in; the output back; backward as much): the ratio says what a mixer layer costs next to one (xLSTM has
  no attention layer: one of the same width, its ``num_heads`` heads of ``hidden_size / num_heads``).

``python -m benchmarks.mixer_cost --sp 2 --tokens 256 --output benchmarks/mixer_cost.md``
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

ELEMENT = 4  # fp32 bytes


@dataclass(frozen=True)
class Mixer:
    """One mixer layer of a family's default config: how to build it, the kernel streams' formula."""

    family: str
    module_class: str
    config_class: str
    layer_idx: int | None = 0  # None: the layer takes no index

    def build(self) -> tuple[nn.Module, Any]:
        import transformers

        config = getattr(transformers, self.config_class)()
        module_path = type(config).__module__.replace("configuration_", "modeling_")
        module_class = getattr(__import__(module_path, fromlist=[self.module_class]), self.module_class)
        torch.manual_seed(0)
        args = (config,) if self.layer_idx is None else (config, self.layer_idx)
        return module_class(*args).float(), config


MIXERS = [
    Mixer("lfm2", "Lfm2ShortConv", "Lfm2Config"),
    Mixer("nemotron_h (Mamba2: also mamba2, Falcon-H1, Zamba2, Granite-4, Bamba)", "NemotronHMamba2Mixer", "NemotronHConfig"),
    Mixer("jamba (Mamba)", "JambaMambaMixer", "JambaConfig"),
    Mixer("qwen3_next (Qwen3.5, OLMo-Hybrid)", "Qwen3NextGatedDeltaNet", "Qwen3NextConfig"),
    Mixer("kimi_linear (Bailing hybrid)", "KimiLinearDeltaAttention", "KimiLinearConfig"),
    Mixer("minimax", "MiniMaxLightningAttention", "MiniMaxConfig"),
    Mixer("recurrent_gemma", "RecurrentGemmaRecurrentBlock", "RecurrentGemmaConfig"),
    Mixer("xlstm (mLSTM)", "xLSTMLayer", "xLSTMConfig", layer_idx=None),
]


def formula(module: nn.Module, sp: int) -> int:
    """All-to-all elements per token of a rank's shard, forward and backward, from the layer's dimensions alone."""
    from lightning_ulysses.heads import plan_heads

    def slots(heads: int, groups: int | None = None) -> tuple[int, int]:
        layout = plan_heads(heads, heads if groups is None else groups, sp)
        return len(layout.query_slots), len(layout.kv_slots)

    name = type(module).__name__
    if name == "Lfm2ShortConv":  # the convolution, in and out
        forward = 2 * slots(module.conv.in_channels)[0]
    elif name.endswith("Mamba2Mixer"):  # x|B|C convolution in and out; x, dt, B, C into the scan, y out
        heads, group_slots = slots(module.num_heads, module.n_groups)
        forward = 2 * slots(module.conv_dim)[0] + heads * (2 * module.head_dim + 1) + 2 * group_slots * module.ssm_state_size
    elif name == "JambaMambaMixer":  # x convolution in and out; x, dt, z into the scan, y out; B, C (one group)
        channels, group_slots = slots(module.intermediate_size, 1)
        forward = 2 * channels + 4 * channels + 2 * group_slots * module.ssm_state_size
    elif name == "Qwen3NextGatedDeltaNet":  # q|k|v convolution in and out; q, k (key heads), v, g, beta in; out
        heads, group_slots = slots(module.num_v_heads, module.num_k_heads)
        forward = 2 * slots(module.conv_dim)[0] + 2 * group_slots * module.head_k_dim + heads * (2 * module.head_v_dim + 2)
    elif name == "KimiLinearDeltaAttention":  # q|k|v convolution in and out; q, k, v, g (per key channel), beta; out
        forward = 2 * slots(module.conv_dim)[0] + slots(module.num_heads)[0] * (5 * module.head_dim + 1)
    elif name == "MiniMaxLightningAttention":  # q, k, v in, out
        forward = slots(module.num_attention_heads)[0] * 4 * module.head_dim
    elif name == "RecurrentGemmaRecurrentBlock":  # x into the convolution + RG-LRU, out
        forward = 2 * slots(module.rg_lru.num_attention_heads)[0] * module.rg_lru.block_width
    elif name == "xLSTMLayer":  # q, k, v and the two gates in (one stream), h out
        heads = module.config.num_heads
        forward = slots(heads)[0] * (2 * module.qk_dim // heads + 2 * module.v_dim // heads + 2)
    else:
        raise ValueError(f"no formula for {name}")
    return 2 * forward


def attention_formula(config: Any) -> int:
    """A softmax-attention layer of the family (of the same width, ``num_heads`` heads, where it has none: xLSTM):
    q, k, v in, the output back, forward and backward."""
    heads = getattr(config, "num_attention_heads", None) or config.num_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * 2 * (heads + kv_heads) * head_dim


def saved_bytes(run: Any, module: nn.Module) -> tuple[Any, int]:
    """``run()`` and the bytes of the distinct storages (weights and buffers excluded) that autograd saves for
    backward while it builds its graph."""
    weights = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    storages: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(storages.values())


def worker(args: dict[str, Any]) -> list[dict[str, Any]]:
    from lightning_ulysses.attention import collectives
    from lightning_ulysses.hf.mixers import shard_token_mixers
    from lightning_ulysses.hf.patching import PatchState

    dist.init_process_group("gloo")
    sp, rank, tokens = dist.get_world_size(), dist.get_rank(), args["tokens"]
    counted = [0]
    original = collectives.all_to_all

    def counting(x: Tensor, group: Any, *rest: Any) -> Tensor:
        counted[0] += x.numel() * x.element_size()
        return original(x, group, *rest)

    collectives.all_to_all = counting
    rows = []
    for mixer in MIXERS:
        module, config = mixer.build()
        hidden = torch.randn(1, tokens, config.hidden_size, generator=torch.Generator().manual_seed(1))
        shard = hidden[:, rank * tokens // sp : (rank + 1) * tokens // sp].clone().requires_grad_()
        whole = hidden.clone().requires_grad_()

        def call(x: Tensor, position_ids: Tensor) -> Tensor:
            if mixer.module_class == "MiniMaxLightningAttention":
                out = module(x, None, None)
            elif mixer.module_class == "RecurrentGemmaRecurrentBlock":
                out = module(x, position_ids, None, use_cache=False)
            else:
                out = module(x)
            return out[0] if isinstance(out, tuple) else out

        positions = torch.arange(tokens)[None]
        _, whole_saved = saved_bytes(lambda: call(whole, positions), module)  # one process, the whole sequence
        state = PatchState(dist.group.WORLD, "sdpa", sp)
        state.position_ids = positions[:, rank * tokens // sp : (rank + 1) * tokens // sp]
        holder = nn.ModuleDict({"mixer": module})
        if not shard_token_mixers(holder, state):
            raise RuntimeError(f"{mixer.module_class} was not recognised as a token mixer")
        counted[0] = 0
        out, sharded_saved = saved_bytes(lambda: call(shard, state.position_ids), module)
        out.sum().backward()
        local_tokens = tokens // sp
        rows.append({
            "family": mixer.family, "module": mixer.module_class, "measured": counted[0] / local_tokens,
            "formula": formula(module, sp) * ELEMENT,
            "attention": attention_formula(config) * ELEMENT,
            "saved_whole": whole_saved / tokens, "saved_sharded": sharded_saved / local_tokens,
            "saved_ratio": sharded_saved / whole_saved,
        })
    dist.destroy_process_group()
    return rows


def report(rows: list[dict[str, Any]], sp: int, tokens: int) -> str:
    lines = [
        f"# Token mixers under Ulysses: cost per layer and token (sp={sp}, {tokens} tokens, fp32)",
        "",
        "Generated by `python -m benchmarks.mixer_cost --sp {sp} --tokens {tokens} --output benchmarks/mixer_cost.md`"
        .format(sp=sp, tokens=tokens) + " (see its docstring). All-to-all bytes are one rank's send buffers, "
        "forward and backward, per token of its shard; activation memory is what autograd keeps for backward, "
        "per token of the rank's shard, against one process holding the whole sequence.",
        "",
        "| family | layer | all-to-all measured (B/token) | formula (B/token) | attention layer (B/token) | "
        "mixer / attention | kept for backward, 1 process (B/token) | sharded (B/token) | sharded / 1 process, per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | `{r['module']}` | {r['measured']:.0f} | {r['formula']:.0f} | {r['attention']:.0f} | "
            f"{r['measured'] / r['attention']:.2f} | {r['saved_whole']:.0f} | {r['saved_sharded']:.0f} | "
            f"{r['saved_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from tests.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = launch("benchmarks.mixer_cost:worker", args.sp, {"tokens": args.tokens}, timeout=1800)[0]
    text = report(rows, args.sp, args.tokens)
    print(text)
    if args.output:
        args.output.write_text(text)
    return rows


if __name__ == "__main__":
    main()
