"""All-to-all bytes and activation memory of the head-sharded token mixers, per layer and token, measured and
compared with the formula.

One mixer layer per kernel family, at the dimensions of the family's default config (the flagship checkpoint's, as
transformers ships them), runs forward and backward on ``--tokens`` tokens split over ``--sp`` CPU processes
(gloo, fp32, batch 1) with :func:`~lightning_ulysses.hf.apply.shard_token_mixers`:

* **all-to-all bytes**: every call of :func:`lightning_ulysses.attention.collectives.all_to_all` (both directions,
  forward and backward) is counted: the send buffer of one rank, the chunk it keeps included, divided by the tokens
  of its shard. The formula: each sharded stream sends ``slots * dim`` elements per token, where ``slots`` is the
  number of head (or group, or channel) slots over all ranks (:func:`~lightning_ulysses.heads.plan_heads`), into
  the kernel and out of it, and as much again in backward.
* **halo bytes**: the token shifts (RWKV's ``time_shift``, ZAYA's delayed values,
  :func:`~lightning_ulysses.hf.mixers.shift.shift_sequence`) send no all-to-all of the sequence: forward, one
  all-gather of each shard piece's last ``k`` tokens (the buffer sent, ``k C``), backward, their gradients back by
  an all-to-all (``P k C``): ``(P + 1) k C`` elements per shift and rank whatever the sequence length, counted here
  per token of the shard.
* **activation memory**: the bytes that autograd keeps for backward (``saved_tensors_hooks``, each storage once,
  the layer's weights and buffers not counted, nor this rank's slices of them, which are views),
  per token of the rank's shard, sharded at ``--sp`` and on one process with the whole sequence: the sharded form
  keeps ``1/sp`` of it per rank (the ``gather`` fallback keeps all of it on every rank).
* **against attention**: a softmax-attention layer of the same family sends ``2 * (H + H_kv) * D`` elements per token
  (q, k, v in; the output back; backward as much; for a family with none, multi-head attention of the model's
  width: xLSTM's ``num_heads`` heads of ``hidden_size / num_heads``, ``4 C`` for RWKV): the ratio (all-to-all and
  halo) says what a mixer layer costs next to one.

``python -m benchmarks.mixer_cost --sp 2 --tokens 256 --output benchmarks/mixer_cost.md``
"""

from __future__ import annotations

import argparse
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.measure import publish

ELEMENT = 4  # fp32 bytes


@dataclass(frozen=True)
class Mixer:
    """One mixer layer of a family's default config: how to build it, the kernel streams' formula."""

    family: str
    module_class: str
    config_class: str
    layer_idx: int | None = 0  # None: the layer takes no index
    nones: int = 0
    """``None`` arguments after the hidden states (the cache and mask arguments that the layer's forward requires)."""
    outputs: int = 1
    """How many leading outputs of the layer are its per-token outputs (ZAYA's projection: query, key, value)."""
    positions: bool = False
    """The layer takes the position ids after the hidden states (RecurrentGemma's block, and ``use_cache=False``)."""

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
    Mixer(
        "nemotron_h (Mamba2: also mamba2, Falcon-H1, Zamba2, Granite-4, Bamba)",
        "NemotronHMamba2Mixer",
        "NemotronHConfig",
    ),
    Mixer("jamba (Mamba)", "JambaMambaMixer", "JambaConfig"),
    Mixer("qwen3_next (Qwen3.5, OLMo-Hybrid)", "Qwen3NextGatedDeltaNet", "Qwen3NextConfig"),
    Mixer("kimi_linear (Bailing hybrid)", "KimiLinearDeltaAttention", "KimiLinearConfig"),
    Mixer("minimax", "MiniMaxLightningAttention", "MiniMaxConfig", nones=2),
    Mixer("recurrent_gemma", "RecurrentGemmaRecurrentBlock", "RecurrentGemmaConfig", nones=1, positions=True),
    Mixer("xlstm (mLSTM)", "xLSTMLayer", "xLSTMConfig", layer_idx=None),
    Mixer("rwkv (WKV and its token shift)", "RwkvSelfAttention", "RwkvConfig"),
    Mixer("zaya (CCA convolutions, delayed values)", "ZayaCCAProjection", "ZayaConfig", nones=1, outputs=3),
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
        forward = (
            2 * slots(module.conv_dim)[0] + heads * (2 * module.head_dim + 1) + 2 * group_slots * module.ssm_state_size
        )
    elif name == "JambaMambaMixer":  # x convolution in and out; x, dt, z into the scan, y out; B, C (one group)
        channels, group_slots = slots(module.intermediate_size, 1)
        forward = 2 * channels + 4 * channels + 2 * group_slots * module.ssm_state_size
    elif name == "Qwen3NextGatedDeltaNet":  # q|k|v convolution in and out; q, k (key heads), v, g, beta in; out
        # a layer that repeats q and k to the value heads before the kernel (transformers 5.17's) sends them so
        expanded = "repeat_interleave" in inspect.getsource(type(module).forward)
        heads, group_slots = slots(module.num_v_heads, module.num_v_heads if expanded else module.num_k_heads)
        forward = (
            2 * slots(module.conv_dim)[0] + 2 * group_slots * module.head_k_dim + heads * (2 * module.head_v_dim + 2)
        )
    elif name == "KimiLinearDeltaAttention":  # q|k|v convolution in and out; q, k, v, g (per key channel), beta; out
        forward = 2 * slots(module.conv_dim)[0] + slots(module.num_heads)[0] * (5 * module.head_dim + 1)
    elif name == "MiniMaxLightningAttention":  # q, k, v in, out
        forward = slots(module.num_attention_heads)[0] * 4 * module.head_dim
    elif name == "RecurrentGemmaRecurrentBlock":  # x into the convolution + RG-LRU, out
        forward = 2 * slots(module.rg_lru.num_attention_heads)[0] * module.rg_lru.block_width
    elif name == "xLSTMLayer":  # q, k, v and the two gates in (one stream), h out
        heads = module.config.num_heads
        forward = slots(heads)[0] * (2 * module.qk_dim // heads + 2 * module.v_dim // heads + 2)
    elif name == "RwkvSelfAttention":  # key, value into the WKV kernel, its output back: one slot per channel
        forward = 3 * slots(module.attention_hidden_size)[0]
    elif name == "ZayaCCAProjection":  # q|k heads into the two convolutions and back
        forward = 2 * slots(module.num_attention_heads + module.num_key_value_heads)[0] * module.head_dim
    else:
        raise ValueError(f"no formula for {name}")
    return 2 * forward


def halo_formula(module: nn.Module, sp: int, tokens: int) -> float:
    """Halo elements per token of a rank's shard, forward and backward: ``(sp + 1) k C`` per token shift (one piece
    per shard, plain Ulysses) over the shard's ``tokens / sp`` tokens."""
    from lightning_ulysses.hf.mixers.shift import sequence_shift_of

    name = type(module).__name__
    if name == "ZayaCCAProjection":  # the delayed half of every value head
        shifted = module.v_proj_delayed.out_features
    else:  # RWKV: its time_shift, on the hidden states
        shifted = sum(module.config.hidden_size for m in module.modules() if sequence_shift_of(m))
    return (sp + 1) * shifted / (tokens / sp)


def attention_formula(config: Any) -> int:
    """A softmax-attention layer of the family: q, k, v in, the output back, forward and backward; for a family with
    none, multi-head attention of the model's width (xLSTM: its ``num_heads`` heads; RWKV: ``4 C``)."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None)
    if heads is None:
        return 2 * 2 * 2 * config.hidden_size
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * 2 * (heads + kv_heads) * head_dim


def saved_bytes(run: Any, module: nn.Module) -> tuple[Any, int]:
    """``run()`` and the bytes of the distinct storages (the layer's weights and buffers, and views of them,
    excluded) that autograd saves for backward while it builds its graph."""
    weights = {p.untyped_storage().data_ptr() for p in (*module.parameters(), *module.buffers())}
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
    from lightning_ulysses.groups import SequenceParallelGroups
    from lightning_ulysses.hf.apply import shard_token_mixers
    from lightning_ulysses.hf.ledger import Ledger
    from lightning_ulysses.hf.mixers import shift
    from lightning_ulysses.hf.state import ForwardBatch, PatchState

    dist.init_process_group("gloo")
    sp, rank, tokens = dist.get_world_size(), dist.get_rank(), args["tokens"]
    counted, halo = [0], [0]
    original, all_gather = collectives.all_to_all, shift.all_gather

    def counting(x: Tensor, group: Any, *rest: Any) -> Tensor:
        counted[0] += x.numel() * x.element_size()
        return original(x, group, *rest)

    def counting_halo(x: Tensor, group: Any, *rest: Any) -> Tensor:  # the halo's gradient, back to its owners
        halo[0] += x.numel() * x.element_size()
        return original(x, group, *rest)

    def gathering_halo(x: Tensor, group: Any) -> Tensor:  # each piece's last tokens, to every rank
        halo[0] += x.numel() * x.element_size()
        return all_gather(x, group)

    collectives.all_to_all, shift.all_to_all, shift.all_gather = counting, counting_halo, gathering_halo
    rows = []
    for mixer in MIXERS:
        module, config = mixer.build()
        hidden = torch.randn(1, tokens, config.hidden_size, generator=torch.Generator().manual_seed(1))
        shard = hidden[:, rank * tokens // sp : (rank + 1) * tokens // sp].clone().requires_grad_()
        whole = hidden.clone().requires_grad_()

        # B023: call and the lambdas below run in the iteration that defines them, on its mixer and tensors
        def call(x: Tensor, position_ids: Tensor) -> Tensor:
            leading = (position_ids,) if mixer.positions else ()  # noqa: B023
            extra = {"use_cache": False} if mixer.positions else {}  # noqa: B023
            out = module(x, *leading, *[None] * mixer.nones, **extra)  # noqa: B023
            out = out if isinstance(out, tuple) else (out,)
            return torch.cat([o.flatten() for o in out[: mixer.outputs]])  # noqa: B023

        positions = torch.arange(tokens)[None]
        _, whole_saved = saved_bytes(lambda: call(whole, positions), module)  # noqa: B023 - one process, whole sequence
        state = PatchState(SequenceParallelGroups.of(init_device_mesh("cpu", (sp,))), "sdpa", sp)
        state.forward = ForwardBatch(positions[:, rank * tokens // sp : (rank + 1) * tokens // sp])
        holder = nn.ModuleDict({"mixer": module})
        if not shard_token_mixers(holder, state, Ledger()):
            raise RuntimeError(f"{mixer.module_class} was not recognised as a token mixer")
        counted[0] = halo[0] = 0
        out, sharded_saved = saved_bytes(lambda: call(shard, state.forward.position_ids), module)  # noqa: B023
        out.sum().backward()
        local_tokens = tokens // sp
        rows.append(
            {
                "family": mixer.family,
                "module": mixer.module_class,
                "measured": counted[0] / local_tokens,
                "formula": formula(module, sp) * ELEMENT,
                "halo": halo[0] / local_tokens,
                "halo_formula": halo_formula(module, sp, tokens) * ELEMENT,
                "attention": attention_formula(config) * ELEMENT,
                "saved_whole": whole_saved / tokens,
                "saved_sharded": sharded_saved / local_tokens,
                "saved_ratio": sharded_saved / whole_saved,
            }
        )
    dist.destroy_process_group()
    return rows


def report(rows: list[dict[str, Any]], sp: int, tokens: int) -> str:
    lines = [
        f"# Token mixers under Ulysses: cost per layer and token (sp={sp}, {tokens} tokens, fp32)",
        "",
        f"Generated by `python -m benchmarks.mixer_cost --sp {sp} --tokens {tokens} --output benchmarks/mixer_cost.md`"
        + " (see its docstring). All-to-all bytes are one rank's send buffers, "
        "forward and backward, per token of its shard; activation memory is what autograd keeps for backward, "
        "per token of the rank's shard, against one process holding the whole sequence.",
        "",
        "| family | layer | all-to-all measured (B/token) | formula (B/token) | halo measured (B/token) | "
        "formula (B/token) | attention layer (B/token) | mixer / attention | kept for backward, 1 process (B/token) | "
        "sharded (B/token) | sharded / 1 process, per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | `{r['module']}` | {r['measured']:.0f} | {r['formula']:.0f} | {r['halo']:.0f} | "
            f"{r['halo_formula']:.0f} | {r['attention']:.0f} | {(r['measured'] + r['halo']) / r['attention']:.2f} | "
            f"{r['saved_whole']:.0f} | {r['saved_sharded']:.0f} | "
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
    publish(text, args.output)
    return rows


if __name__ == "__main__":
    main()
