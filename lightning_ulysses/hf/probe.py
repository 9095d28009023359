"""The set-up check: run a patched model once on a few tokens and refuse it unless every layer is exact.

Detection is by what the model does, not by its name. A few short ``no_grad`` forwards in eval mode
(two rows of ``N = sp * PROBE_TOKENS_PER_RANK`` tokens), with every attention layer replaced by
*token-local attention* (each token attends only to itself: ``out = v * sigmoid(scale * q.k)``, so
queries, keys and values all still matter, but no information moves between tokens through attention):

1. **Whole sequence, one rank.** transformers builds its masks through
   :func:`~lightning_ulysses.hf.masks.recording_mask_interface`; each attention layer's call is read
   (:func:`~lightning_ulysses.hf.interface.read_layer_call`): the mask pattern it receives (windows and
   chunks applied only through the mask included) and its arguments (sinks; soft-capping, bidirectional
   attention, model-computed biases are refused). Every module's inputs and outputs are kept.
2. **Position numbering.** The plain model must compute the same with position ids ``0, 1, 2, ...`` as with
   its own (RoBERTa counts from ``padding_idx + 1``): sequence parallelism must pass global ones.
3. **Rotary embeddings** (``sp > 1``): every module that maps ``position_ids`` to a pair of per-token
   tensors (cos, sin) is called with positions around each ``max_position`` boundary of the config; where
   its output depends on the length (dynamic NTK, longrope), :func:`~lightning_ulysses.hf.rotary.whole_sequence_rotary`
   is installed and must make it exact.
4. **As in training**: this rank's shard (the whole sequence at ``sp_size=1``), the real SP group, no masks
   built. With attention token-local, no module's per-token output may differ from the whole run: where
   one does, something other than attention moves information between tokens (a convolution over the
   sequence, a recurrent / linear-attention / state-space layer), computes from local token indices, or
   reads the attention mask outside attention (sparse-attention indexers). Every module whose inputs
   agree with the whole run is compared on its own outputs (a small mixer is as visible as a large one)
   and the first that differs is named; the model's output must agree too. ``torch.arange`` over the
   shard's length is trapped as well: an index-dependent computation may change nothing at the probe's
   few tokens (Llama4's temperature tuning starts at index 8192).

The verdict is agreed over the SP group, so every rank raises the same :class:`UnsupportedModelError`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from lightning_ulysses.hf import interface
from lightning_ulysses.hf.interface import ULYSSES_ATTN_IMPLEMENTATION, LayerPlan, read_layer_call
from lightning_ulysses.hf.masks import RecordedMasks, recording_mask_interface
from lightning_ulysses.hf.mixers import TokenDims, gather_whole_sequence, remove_gather_whole_sequence
from lightning_ulysses.hf.patching import (
    PatchState,
    UnsupportedModelError,
    model_configs,
    sequence_parallel_disabled,
    unpatched,
)
from lightning_ulysses.hf.rotary import position_ids_index, whole_sequence_rotary

PROBE_TOKENS_PER_RANK = 11
"""Tokens per rank in the probe: an odd count, so that the sequence dimension is told from model dimensions."""

def tolerance(dtype: torch.dtype) -> float:
    """Largest difference, relative to a tensor's largest magnitude, that counts as equal between the whole and
    the sharded probe: kernels may round differently for other shapes (one bf16 ulp is 0.8%). A token mixer
    changes the border tokens of its own output by about their size."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


@dataclass(frozen=True)
class Finding:
    """One reason to refuse: where (module path and class) and what. A module that only mixes tokens outside
    attention also carries its path and where the sequence runs in its tensors, so that it can be run on the
    whole sequence instead (:mod:`lightning_ulysses.hf.mixers`)."""

    where: str
    problem: str
    mixer: str | None = None
    dims: TokenDims | None = None
    enclosing: tuple[tuple[str, TokenDims | None], ...] = ()
    """The modules around ``mixer`` whose outputs differ too, innermost first: where to gather when ``mixer``'s own
    inputs are not the sequence (a convolution fed by another convolution's padded output)."""


@dataclass
class _Call:
    """One call of a module in the whole-sequence run: its tensors, for comparison with the sharded run."""

    inputs: dict[str, Tensor]
    outputs: list[Tensor]
    args: tuple
    kwargs: dict[str, Any]


@dataclass
class _WholeRun:
    calls: dict[str, list[_Call]] = field(default_factory=dict)
    output: Tensor | None = None


def check_model(model: PreTrainedModel, state: PatchState) -> None:
    """Check a patched ``model`` (see the module docstring); store each attention layer's plan on it, or raise
    :class:`UnsupportedModelError` naming every layer that would not run exactly. Collective over ``state.group``."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    input_ids = _probe_ids(model, state.sp_size * PROBE_TOKENS_PER_RANK, device)
    position_ids = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    rank = 0 if state.group is None else dist.get_rank(state.group)
    shard = _Shard(rank, state.sp_size, input_ids.shape[1])
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            findings, whole = _whole_sequence_run(model, state, input_ids, position_ids)
            findings = _agreed(findings, state)  # a forward that failed on one rank only must not leave the others waiting
            if not findings:
                findings = _check_position_numbering(model, input_ids, position_ids)
            if state.sp_size > 1 and not findings:
                findings = _check_rotary(model, state, whole, shard)
            if not findings:
                findings = _run_as_in_training(model, state, input_ids, position_ids, whole, shard)
    finally:
        for module, training in modes.items():
            module.training = training
    if findings:
        raise UnsupportedModelError(_refusal(model, findings, suggest_gather=not state.gather_mixers))


def _probe_ids(model: PreTrainedModel, length: int, device: torch.device) -> Tensor:
    """``[2, length]`` token ids that are no special token of the config (image, audio, ... placeholders). Two rows:
    a flattened ``[2 * tokens]`` axis is then told from the sequence axis."""
    embeddings = model.get_input_embeddings()
    vocab_size = getattr(embeddings, "num_embeddings", None) or model.config.get_text_config().vocab_size
    special = {
        value for config in model_configs(model) for key, value in config.to_dict().items()
        if "token" in key and isinstance(value, int)
    }
    ordinary = [i for i in range(min(vocab_size, 4096)) if i not in special]
    generator = torch.Generator().manual_seed(0)
    choice = torch.randint(len(ordinary), (2, length), generator=generator)
    return torch.tensor(ordinary)[choice].to(device)


# ----------------------------------------------------------------------------------------------
# 1. whole sequence
# ----------------------------------------------------------------------------------------------
def _whole_sequence_run(
    model: PreTrainedModel, state: PatchState, input_ids: Tensor, position_ids: Tensor
) -> tuple[list[Finding], _WholeRun]:
    names = {module: name for name, module in model.named_modules()}
    recorded = RecordedMasks([])
    plans: dict[nn.Module, LayerPlan] = {}
    findings: dict[nn.Module, Finding] = {}
    run = _WholeRun()

    def attention(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, scaling: float | None,
        kwargs: dict[str, Any],
    ) -> Tensor:
        tokens = input_ids.shape[1]
        if query.dim() != 4 or query.shape[2] != tokens or query.shape[0] != input_ids.shape[0]:
            findings[module] = Finding(_where(names, module), f"passes attention tensors shaped {tuple(query.shape)}, not "
                                       f"[batch, heads, tokens={tokens}, dim] as transformers' attention interface does")
            return torch.zeros_like(query)
        if key.shape[2] != tokens:  # keys of its own (compressed, memory, ...): no stand-in attention here
            findings[module] = Finding(_where(names, module), f"attends to {key.shape[2]} keys from {tokens} queries: "
                                       "keys other than the sequence's tokens")
            return query.new_zeros(*query.shape[:2], tokens, value.shape[-1]).transpose(1, 2)
        if module not in findings:
            pattern, why = recorded.pattern_of(attention_mask)
            plan, problems = read_layer_call(module, pattern, why, kwargs)
            if plan is not None and plans.setdefault(module, plan) != plan:
                problems = ["is called with different attention patterns in one forward, and runs one plan per layer"]
            if problems:
                findings[module] = Finding(_where(names, module), "; ".join(problems))
        return token_local_attention(query, key, value, scaling)

    def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        inputs = {key: t.clone() for key, t in _named_inputs(args, kwargs).items()}
        run.calls.setdefault(names[module], []).append(_Call(inputs, [t.clone() for t in _tensors(output)], args, kwargs))

    try:
        with _mask_interface(recording_mask_interface(recorded)), _probe_attention(attention), \
                sequence_parallel_disabled(model), _hooks(model, record):
            output = model(input_ids=input_ids, position_ids=position_ids)
    except Exception as error:  # noqa: BLE001 - any failure of the plain forward is a reason to refuse, with its text
        return [Finding(f"{type(model).__name__}", f"cannot be called with input_ids and position_ids alone ({error})")], run
    run.output = _first_tensor(output)
    for module, plan in plans.items():
        if module not in findings:
            module._ulysses_plan = plan
    return list(findings.values()), run


def token_local_attention(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    """``[B, H, N, D]`` query, ``[B, H_kv, N, D]`` key and ``[B, H_kv, N, D_v]`` value -> ``[B, N, H, D_v]``: every
    token attends only to itself, weighted by ``sigmoid(scale * q.k)`` so that the queries and keys still count."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    weight = torch.sigmoid(scale * (query * key).sum(-1, keepdim=True))
    return (value * weight).transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------------------------
# 2. sharded
# ----------------------------------------------------------------------------------------------
def _run_as_in_training(
    model: PreTrainedModel, state: PatchState, input_ids: Tensor, position_ids: Tensor, whole: _WholeRun,
    shard: _Shard,
) -> list[Finding]:
    """Step 5; with ``state.gather_mixers``, each module found mixing tokens is run on the whole sequence and the
    step repeated (a mixer hides the ones after it), until the model is exact or a finding remains that gathering
    does not remove. Where gathering a module's inputs is not enough, the module around it is gathered instead,
    never one that holds an attention layer (that would run the attention on every rank)."""
    modules = dict(model.named_modules())
    attention = [name for name, module in modules.items() if "_ulysses_plan" in module.__dict__]
    gathered: dict[str, str] = {}  # the mixer found -> the module gathered for it
    while True:
        findings = _agreed(_training_run(model, state, input_ids, position_ids, whole, shard), state)
        if not state.gather_mixers or not findings or any(f.mixer is None for f in findings):
            break
        for finding in findings:
            levels = [(finding.mixer, finding.dims), *finding.enclosing]
            names = [name for name, _ in levels]
            tried = gathered.get(finding.mixer)
            later = names.index(tried) + 1 if tried in names else 0
            choice = next((
                (name, dims) for name, dims in levels[later:]
                if dims is not None and not any(a == name or a.startswith(name + ".") for a in attention)
            ), None)
            if choice is None:
                return findings
            if tried is not None:
                remove_gather_whole_sequence(modules[tried])
            gather_whole_sequence(modules[choice[0]], state, choice[1])
            gathered[finding.mixer] = choice[0]
    if gathered and not findings:
        rank_zero_info(
            f"{type(model).__name__}: {len(gathered)} token mixers outside attention run on the whole sequence on every "
            f"rank (sequence_mixers='gather'): {', '.join(gathered.values())}. Exact, at {state.sp_size}x their compute "
            "and with their activations at full length."
        )
    return findings


def _training_run(
    model: PreTrainedModel, state: PatchState, input_ids: Tensor, position_ids: Tensor, whole: _WholeRun,
    shard: _Shard,
) -> list[Finding]:
    """The forward as training runs it: this rank's shard (the whole sequence at ``sp_size=1``), the real SP group,
    no attention masks built; every module compared with the whole-sequence run."""
    names = {module: name for name, module in model.named_modules()}
    seen: dict[str, int] = {}
    culprits: list[Finding] = []
    differs = (
        "changes its output when the sequence is split: it mixes information between tokens outside attention (a "
        "convolution over the sequence, a recurrent, linear-attention or state-space layer), computes from local token "
        "indices, or reads the attention mask outside attention. Only softmax attention runs across the shards"
        if state.sp_size > 1 else
        "reads the [N, N] attention mask outside attention (its output changes when transformers builds none, as under "
        "sequence parallelism)"
    )

    def compare(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = names[module]
        index = seen[name] = seen.get(name, -1) + 1
        calls = whole.calls.get(name, [])
        encloses = bool(culprits) and culprits[0].mixer is not None and culprits[0].mixer.startswith(name + ".")
        if (culprits and not encloses) or index >= len(calls):
            return
        local_inputs, local_outputs = _named_inputs(args, kwargs), _tensors(output)
        if shard.inputs_agree(calls[index].inputs, local_inputs) and not shard.all_agree(calls[index].outputs, local_outputs):
            dims = shard.token_dims(calls[index], local_inputs, local_outputs) if state.sp_size > 1 else None
            if encloses:
                culprits[0] = replace(culprits[0], enclosing=(*culprits[0].enclosing, (name, dims)))
            else:
                culprits.append(Finding(_where(names, module), differs, name if state.sp_size > 1 else None, dims))

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, scaling: float | None,
                  kwargs: dict[str, Any]) -> Tensor:
        return token_local_attention(query, key, value, scaling)

    trap = _local_index_trap(model, shard.length) if state.sp_size > 1 else nullcontext([])
    try:
        with _probe_attention(attention), _hooks(model, compare), trap as local_indices:
            output = model(input_ids=shard.of(input_ids), position_ids=shard.of(position_ids))
    except Exception as error:  # noqa: BLE001 - the reason to refuse, with its text
        return [Finding(type(model).__name__, "fails when run as under sequence parallelism, where transformers builds no "
                        f"attention mask ({type(error).__name__}: {error})")]
    if culprits or local_indices or shard.agree(whole.output, _first_tensor(output)):
        return culprits + local_indices
    return [Finding(type(model).__name__, differs)]


def _check_position_numbering(model: PreTrainedModel, input_ids: Tensor, position_ids: Tensor) -> list[Finding]:
    """Refuse a model whose own positions are not ``0, 1, 2, ...`` (RoBERTa counts from ``padding_idx + 1``): the global
    position ids that sequence parallelism must pass would change what it computes."""
    with unpatched(model):
        given = _first_tensor(model(input_ids=input_ids, position_ids=position_ids, use_cache=False))
        own = _first_tensor(model(input_ids=input_ids, use_cache=False))
    if given is None or own is None or _close(own, given):
        return []
    return [Finding(type(model).__name__, "numbers its positions other than 0, 1, 2, ... (its output changes when given "
                    "those position ids; e.g. RoBERTa counts from padding_idx + 1), and sequence parallelism must give "
                    "each shard its global position ids")]


@contextmanager
def _local_index_trap(model: nn.Module, length: int) -> Iterator[list[Finding]]:
    """Within the block, report every ``torch.arange`` over ``0 .. length - 1`` (the shard's token indices) that a
    module of ``model`` makes: under SP they are the local indices of one shard, whatever they feed. Such a
    computation may change nothing below some index (Llama4 scales queries by ``log(floor(index / 8192))``), so
    the short probe cannot see it in the outputs."""
    names = {module: name for name, module in model.named_modules()}
    running: list[nn.Module] = []
    found: list[Finding] = []
    original = torch.arange

    def arange(*args: Any, **kwargs: Any) -> Tensor:
        result = original(*args, **kwargs)
        if running and result.dim() == 1 and result.numel() == length and bool(
            (result == original(length, device=result.device, dtype=result.dtype)).all()
        ):
            caller = sys._getframe(1)
            where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
            finding = Finding(_where(names, running[-1]), f"builds token indices from the length of its input "
                              f"(torch.arange at {where}), which under SP is one shard's: local indices, not global ones")
            if finding not in found:
                found.append(finding)
        return result

    def enter(module: nn.Module, args: tuple) -> None:
        running.append(module)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        running.pop()

    handles = [
        handle for module in model.modules()
        for handle in (module.register_forward_pre_hook(enter), module.register_forward_hook(leave))
    ]
    torch.arange = arange
    try:
        yield found
    finally:
        torch.arange = original
        for handle in handles:
            handle.remove()


class _Shard:
    """This rank's shard of the probe sequence, and comparisons of per-token tensors with the whole run."""

    def __init__(self, rank: int, sp_size: int, whole_length: int) -> None:
        self.whole_length, self.length = whole_length, whole_length // sp_size
        self.start = rank * self.length

    def of(self, tensor: Tensor) -> Tensor:
        return tensor[:, self.start : self.start + self.length]

    def slice(self, whole: Tensor, local: Tensor) -> Tensor | None:
        """The part of ``whole`` that corresponds to ``local``: sliced along the token dimension (the one that is
        ``N`` long in ``whole`` and ``N / sp`` in ``local``, every other dimension equal); None if there is none."""
        if whole.dim() != local.dim():
            return None
        for dim, (w, l) in enumerate(zip(whole.shape, local.shape)):
            if (w, l) == (self.whole_length, self.length) and all(
                a == b for d, (a, b) in enumerate(zip(whole.shape, local.shape)) if d != dim
            ):
                return whole.narrow(dim, self.start, self.length)
        return None

    def token_dims(self, whole: _Call, local_inputs: dict[str, Tensor], local_outputs: list[Tensor]) -> TokenDims | None:
        """Where the sequence runs in a module's inputs and outputs (:class:`TokenDims`), from its whole-sequence and
        its shard call; None when an output is not one the shard's rows can be cut from."""
        inputs = {}
        for key, local in local_inputs.items():
            dim = self._sequence_dim(whole.inputs.get(key), local, extra=False)
            if dim is not None:
                inputs[key] = dim
        outputs = {}
        if len(whole.outputs) != len(local_outputs):
            return None
        for i, (w, l) in enumerate(zip(whole.outputs, local_outputs)):
            dim = self._sequence_dim(w, l, extra=True)
            if dim is None and w.shape != l.shape:
                return None
            if dim is not None:
                outputs[i] = dim
        return TokenDims(inputs, outputs)

    def _sequence_dim(self, whole: Tensor | None, local: Tensor, extra: bool) -> int | None:
        """The dimension that is ``N`` long in ``whole`` and ``N / sp`` in ``local`` (or, with ``extra``, longer than
        those by the same constant), every other dimension equal."""
        if whole is None or whole.dim() != local.dim():
            return None
        for dim, (w, l) in enumerate(zip(whole.shape, local.shape)):
            others_equal = all(a == b for d, (a, b) in enumerate(zip(whole.shape, local.shape)) if d != dim)
            if others_equal and w - l == self.whole_length - self.length and (l == self.length or extra and l > self.length):
                return dim
        return None

    def agree(self, whole: Tensor | None, local: Tensor | None) -> bool:
        if whole is None or local is None:
            return whole is local
        part = self.slice(whole, local)
        return part is not None and _close(part, local)

    def inputs_agree(self, whole: dict[str, Tensor], local: dict[str, Tensor]) -> bool:
        """Whether the per-token inputs that both calls received agree (a mask built only for the whole run is
        left out)."""
        keys = [key for key in whole if key in local]
        return self.all_agree([whole[k] for k in keys], [local[k] for k in keys])

    def all_agree(self, whole: list[Tensor], local: list[Tensor]) -> bool:
        """Whether every per-token tensor of ``local`` equals its part of the matching tensor of ``whole``."""
        if len(whole) != len(local):
            return False
        for w, l in zip(whole, local):
            part = self.slice(w, l)
            if part is not None and not _close(part, l):
                return False
        return True


def _close(expected: Tensor, got: Tensor) -> bool:
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return False
    if not expected.is_floating_point():
        return bool(torch.equal(expected, got))
    scale = expected.abs().amax().clamp(min=1e-6)
    return bool(((expected - got).abs().amax() <= tolerance(expected.dtype) * scale).item())


# ----------------------------------------------------------------------------------------------
# 3. rotary embeddings
# ----------------------------------------------------------------------------------------------
def _check_rotary(model: PreTrainedModel, state: PatchState, whole: _WholeRun, shard: _Shard) -> list[Finding]:
    modules = dict(model.named_modules())
    names = {module: name for name, module in modules.items()}
    boundaries = sorted(_position_boundaries(model))
    rotary = [(modules[name], calls[0]) for name, calls in whole.calls.items() if _is_rotary(modules[name], calls[0])]

    def length_dependent(module: nn.Module, call: _Call) -> bool:
        for boundary in boundaries:
            offset = max(boundary - shard.length, 0)  # the whole sequence straddles the boundary, the first shard not
            expected = _call_with_positions(module, call, offset, shard, whole_sequence=True)
            got = _call_with_positions(module, call, offset, shard, whole_sequence=False)
            if not shard.all_agree(expected, got):
                return True
        return False

    flags = torch.tensor([length_dependent(m, call) for m, call in rotary], dtype=torch.int32)
    dependent = [m for (m, _), flag in zip(rotary, _any_rank(flags, state)) if flag]
    for module in dependent:
        whole_sequence_rotary(module, state)
    flags = torch.tensor([length_dependent(m, call) for m, call in rotary if m in dependent], dtype=torch.int32)
    inexact = [m for m, flag in zip(dependent, _any_rank(flags, state)) if flag]
    return [
        Finding(_where(names, m), "computes rotary frequencies from the sequence length in a way that giving it the "
                "whole sequence's largest position does not make exact")
        for m in inexact
    ]


def _is_rotary(module: nn.Module, call: _Call) -> bool:
    """A module without weights that maps ``position_ids`` to a pair of per-token tensors."""
    try:
        bound = inspect.signature(module.forward).bind(*call.args, **call.kwargs)
    except TypeError:
        return False
    positions = bound.arguments.get("position_ids")
    return (
        isinstance(positions, Tensor) and len(call.outputs) == 2
        and all(t.dim() >= 2 and t.shape[-2] == positions.shape[-1] for t in call.outputs)
        and next(module.parameters(), None) is None
    )


def _call_with_positions(module: nn.Module, call: _Call, offset: int, shard: _Shard, whole_sequence: bool) -> list[Tensor]:
    """``module`` called as in ``call`` but with its position ids moved up by ``offset`` (and, for a shard, every
    per-token input cut to the shard), restoring whatever state the call changes (dynamic RoPE caches its
    frequencies)."""
    args, kwargs = list(call.args), dict(call.kwargs)
    index = position_ids_index(module)
    in_args = index is not None and index < len(args)
    if in_args:
        args[index] = args[index] + offset
    else:
        kwargs["position_ids"] = kwargs["position_ids"] + offset
    if not whole_sequence:
        args = [_shard_of(a, shard) for a in args]
        kwargs = {k: _shard_of(v, shard) for k, v in kwargs.items()}
    with _restored(module):
        return _tensors(module(*args, **kwargs))


def _shard_of(value: Any, shard: _Shard) -> Any:
    """``value`` cut to the shard along its token dimension (the last that is ``N`` long), if it has one."""
    if not isinstance(value, Tensor):
        return value
    for dim in reversed(range(1, value.dim())):
        if value.shape[dim] == shard.whole_length:
            return value.narrow(dim, shard.start, shard.length)
    return value


@contextmanager
def _restored(module: nn.Module) -> Iterator[None]:
    buffers = {name: b.clone() if b is not None else None for name, b in module._buffers.items()}
    attributes = dict(module.__dict__)
    try:
        yield
    finally:
        module._buffers = buffers
        for name in [n for n in module.__dict__ if n not in attributes]:
            del module.__dict__[name]
        module.__dict__.update({k: v for k, v in attributes.items() if k != "_buffers"})


def _position_boundaries(model: PreTrainedModel) -> set[int]:
    """0 and every ``*max_position*`` integer of the configs (rope parameters included): where length-dependent
    RoPE changes its frequencies."""
    found = {0}
    pending: list[Any] = [config.to_dict() for config in model_configs(model)]
    while pending:
        item = pending.pop()
        for key, value in item.items():
            if isinstance(value, dict):
                pending.append(value)
            elif isinstance(key, str) and "max_position" in key and isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.add(value)
    return found


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _agreed(findings: list[Finding], state: PatchState) -> list[Finding]:
    """The union of every SP rank's findings, in rank order (every rank then refuses alike)."""
    if state.group is None or state.sp_size == 1:
        return findings
    gathered: list[list[Finding]] = [[] for _ in range(state.sp_size)]
    dist.all_gather_object(gathered, findings, group=state.group)
    merged: list[Finding] = []
    for rank_findings in gathered:
        merged += [f for f in rank_findings if f not in merged]
    return merged


def _any_rank(flags: Tensor, state: PatchState) -> list[bool]:
    """Element-wise OR of ``flags`` over the SP group (gloo and NCCL alike: via the default device of the group)."""
    if flags.numel() == 0:
        return []
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(state.group) == "nccl" else "cpu"
    flags = flags.to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=state.group)
    return [bool(f) for f in flags.tolist()]


def _where(names: dict[nn.Module, str], module: nn.Module) -> str:
    return f"{names.get(module, '?') or '<model>'} ({type(module).__name__})"


def _refusal(model: PreTrainedModel, findings: list[Finding], suggest_gather: bool) -> str:
    shown = findings[:8]
    lines = [f"  - {f.where}: {f.problem}" for f in shown]
    if len(findings) > len(shown):
        lines.append(f"  - ... and {len(findings) - len(shown)} more")
    if suggest_gather and all(f.mixer is not None for f in findings):
        lines.append(
            "  UlyssesStrategy(sequence_mixers='gather') runs such layers on the whole sequence on every rank instead: "
            "exact, at sp_size times their compute and with their activations at full length."
        )
    return (
        f"{type(model).__name__} cannot be trained exactly with Ulysses sequence parallelism; lightning-ulysses checked "
        "it at set-up, before any step:\n" + "\n".join(lines) + "\n"
        "Train this model without sequence parallelism (sp_size=1 on a plain strategy), or use a model whose layers "
        "mix tokens only through softmax attention (docs/model-support.md lists every transformers family)."
    )


def _tensors(value: Any) -> list[Tensor]:
    """Every tensor in a (nested) output or argument structure, in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return _tensors(value.to_tuple())
    return []


def _named_inputs(args: tuple, kwargs: dict[str, Any]) -> dict[str, Tensor]:
    """The tensors among a call's arguments, keyed by position or name (``arg0``, ``position_embeddings.1``, ...)."""
    named: dict[str, Tensor] = {}
    for key, value in [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items()):
        tensors = _tensors(value)
        if isinstance(value, Tensor):
            named[key] = value
        else:
            named.update({f"{key}.{i}": t for i, t in enumerate(tensors)})
    return named


def _first_tensor(output: Any) -> Tensor | None:
    tensors = _tensors(output)
    return tensors[0] if tensors else None


@contextmanager
def _hooks(model: nn.Module, hook: Any) -> Iterator[None]:
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _probe_attention(function: Any) -> Iterator[None]:
    interface.set_probe_attention(function)
    try:
        yield
    finally:
        interface.set_probe_attention(None)


@contextmanager
def _mask_interface(function: Any) -> Iterator[None]:
    ALL_MASK_ATTENTION_FUNCTIONS.register(ULYSSES_ATTN_IMPLEMENTATION, function)
    try:
        yield
    finally:
        del ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[ULYSSES_ATTN_IMPLEMENTATION]
