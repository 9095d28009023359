"""Step 6 of the set-up check: the forward as training runs it (this rank's shard, no masks), compared module by
module with the whole-sequence run; with ``sequence_mixers="gather"``, the token mixers it finds gathered."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from transformers import PreTrainedModel

from lightning_ulysses.hf.check.findings import agreed, module_label
from lightning_ulysses.hf.check.shard import Shard
from lightning_ulysses.hf.check.tensors import first_tensor, hooks, named_inputs, tensors_of
from lightning_ulysses.hf.check.whole import WholeRun, probe_attention, token_local_probe
from lightning_ulysses.hf.plan import Finding, Gathered, ModelPlan
from lightning_ulysses.hf.state import PatchState


def run_as_in_training(
    model: PreTrainedModel,
    state: PatchState,
    input_ids: Tensor,
    position_ids: Tensor,
    whole: WholeRun,
    shard: Shard,
    plan: ModelPlan,
    realize: Callable[[ModelPlan], None],
) -> tuple[list[Finding], ModelPlan]:
    """Step 6; with ``state.gather_mixers``, each module found mixing tokens is planned (and realised) to run on the
    whole sequence and the step repeated (a mixer hides the ones after it), until the model is exact or a finding
    remains that gathering does not remove. Where gathering a module's inputs is not enough, the module around it is
    gathered instead, never one that holds an attention layer (that would run the attention on every rank). A
    gathered module that still differs is a finding of its own: the module around it is tried next. The search ends
    (and the findings stand) when a plan comes round again."""
    attention = [name for name, _ in plan.layers]
    tried_plans: set[tuple[tuple[str, str], ...]] = set()
    while True:
        chunked = tuple(name for name, layer in plan.layers if layer.projection_chunks is not None)
        findings = agreed(training_run(model, state, input_ids, position_ids, whole, shard, chunked), state)
        if not state.gather_mixers or not findings or any(f.mixer is None for f in findings):
            return findings, plan
        for finding in findings:
            assert finding.mixer is not None
            levels = [(finding.mixer, finding.dims), *finding.enclosing]
            names = [name for name, _ in levels]
            tried = next((g.module for g in plan.gathered if finding.mixer in (g.mixer, g.module)), None)
            later = names.index(tried) + 1 if tried in names else 0
            choice = next(
                (
                    Gathered(finding.mixer, name, dims)
                    for name, dims in levels[later:]
                    if dims is not None and not any(a == name or a.startswith(name + ".") for a in attention)
                ),
                None,
            )
            if choice is None:
                return findings, plan
            plan = plan.with_gathered(choice)  # a sharded mixer inside runs as it is: its kernels did not make it exact
        choices = tuple((g.mixer, g.module) for g in plan.gathered)
        if choices in tried_plans:
            return findings, plan
        tried_plans.add(choices)
        realize(plan)


def training_run(
    model: PreTrainedModel,
    state: PatchState,
    input_ids: Tensor,
    position_ids: Tensor,
    whole: WholeRun,
    shard: Shard,
    chunked: tuple[str, ...] = (),
) -> list[Finding]:
    """The forward as training runs it: this rank's shard (the whole sequence at ``sp_size=1``), the real SP group,
    no attention masks built; every module compared with the whole-sequence run, except those inside the ``chunked``
    attention modules (their projections run narrowed, once per head chunk; the modules' own outputs are compared)."""
    names = {module: name for name, module in model.named_modules()}
    seen: dict[str, int] = {}
    culprits: list[Finding] = []
    differs = (
        "changes its output when the sequence is split: it mixes information between tokens outside attention (a "
        "convolution over the sequence, a recurrent, linear-attention or state-space layer), computes from local token "
        "indices, or reads the attention mask outside attention. Only softmax attention runs across the shards"
        if state.sp_size > 1
        else "reads the [N, N] attention mask outside attention (its output changes when transformers builds none, as "
        "under sequence parallelism)"
    )

    def compare(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = names[module]
        if any(name.startswith(outer + ".") for outer in chunked):
            return
        index = seen[name] = seen.get(name, -1) + 1
        calls = whole.calls.get(name, [])
        encloses = bool(culprits) and culprits[0].mixer is not None and culprits[0].mixer.startswith(name + ".")
        if (culprits and not encloses) or index >= len(calls):
            return
        local_inputs, local_outputs = named_inputs(module, args, kwargs), tensors_of(output)
        agree = shard.inputs_agree(calls[index].inputs, local_inputs)
        if agree and not shard.all_agree(calls[index].outputs, local_outputs):
            dims = shard.token_dims(calls[index], local_inputs, local_outputs) if state.sp_size > 1 else None
            if encloses:
                culprits[0] = replace(culprits[0], enclosing=(*culprits[0].enclosing, (name, dims)))
            else:
                mixer = name if state.sp_size > 1 else None
                culprits.append(Finding(module_label(names, module), differs, mixer, dims))

    no_trap: AbstractContextManager[list[Finding]] = nullcontext([])
    trap = local_index_trap(model, shard.length) if state.sp_size > 1 else no_trap
    try:
        with probe_attention(state, token_local_probe), hooks(model, compare), trap as local_indices:
            output = model(input_ids=shard.of(input_ids), position_ids=shard.of(position_ids))
    except Exception as error:  # noqa: BLE001 - the reason to refuse, with its text
        return [
            Finding(
                type(model).__name__,
                "fails when run as under sequence parallelism, where transformers builds "
                f"no attention mask ({type(error).__name__}: {error})",
            )
        ]
    if culprits or local_indices or shard.agree(whole.output, first_tensor(output)):
        return culprits + local_indices
    return [Finding(type(model).__name__, differs)]


@contextmanager
def local_index_trap(model: nn.Module, length: int) -> Iterator[list[Finding]]:
    """Within the block, report every ``torch.arange`` over ``0 .. length - 1`` (the shard's token indices) that a
    module of ``model`` makes: under SP they are the local indices of one shard, whatever they feed. Such a
    computation may change nothing below some index (Llama4 scales queries by ``log(floor(index / 8192))``), so
    the short probe cannot see it in the outputs. The calls are seen through a torch function mode of this thread,
    which leaves when the block does (``torch.arange`` itself is never replaced)."""
    names = {module: name for name, module in model.named_modules()}
    running: list[nn.Module] = []
    trap = _LocalIndices(length, names, running)

    def enter(module: nn.Module, args: tuple) -> None:
        running.append(module)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        running.pop()

    handles = [
        handle
        for module in model.modules()
        for handle in (module.register_forward_pre_hook(enter), module.register_forward_hook(leave))
    ]
    try:
        with trap:
            yield trap.found
    finally:
        for handle in handles:
            handle.remove()


class _LocalIndices(TorchFunctionMode):
    """The ``torch.arange`` calls over ``0 .. length - 1`` made inside a module of ``running``'s (innermost last),
    as findings naming that module and the calling line."""

    def __init__(self, length: int, names: dict[nn.Module, str], running: list[nn.Module]) -> None:
        super().__init__()
        self.length, self.names, self.running = length, names, running
        self.found: list[Finding] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))  # the mode is off inside its own handler: no recursion
        if (
            func is torch.arange
            and self.running
            and result.dim() == 1
            and result.numel() == self.length
            and bool((result == torch.arange(self.length, device=result.device, dtype=result.dtype)).all())
        ):
            caller = sys._getframe(1)  # torch.arange is C code: the frame that called it
            where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
            finding = Finding(
                module_label(self.names, self.running[-1]),
                f"builds token indices from the length of its input "
                f"(torch.arange at {where}), which under SP is one shard's: local indices, not global "
                "ones",
            )
            if finding not in self.found:
                self.found.append(finding)
        return result
