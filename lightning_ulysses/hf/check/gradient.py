"""Step 8 of the set-up check (``sp > 1``): the model adds no gradient of its own in training.

Some modules attach a loss that only the backward sees: DeepSeek-V2's remote-code MoE returns
``AddAuxiliaryLoss.apply(y, aux_loss)``, an identity whose backward gives ``aux_loss`` a gradient of 1, so that the
load-balancing loss reaches the router without appearing in the model's loss. Under sequence parallelism each rank
would compute that loss from its shard of the sequence's tokens (a nonlinear statistic of the shard, not of the whole
sequence), with a gradient of 1 per rank that the SP loss scale does not reach: the router's update would differ
silently from one process's. Found by behaviour: the model with sequence parallelism disabled (the whole sequence on
one rank, as exact as the plain model, with the patch's kernels: a token mixer runs its sharded kernels at ``sp=1``,
not a fused training kernel), in training mode with autograd on, on the check's probe tokens, must give the input
embeddings' output a zero gradient when every output it returns gets one (:func:`torch.autograd.grad`: no ``.grad`` is
written, no parameter's gradient hook runs). The gradient is taken with respect to that one ``[B, N, hidden]`` tensor,
not the parameters: a loss computed from the tokens reaches it, and a model's worth of parameter gradients at set-up
would not fit where the weights barely do (ZeRO-3); the modules are named only where it is non-zero. Module backward
hooks are kept from firing (:func:`~lightning_ulysses.hf.check.tensors.backward_hooks_off`: ZeRO-3 reduces leaf
modules' gradients in them); ZeRO-3 gathers the parameters through its forward hooks, for the forward and the
backward, as in the check's other calls. Modes and random states are restored.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_ulysses.hf.apply import sequence_parallel_disabled
from lightning_ulysses.hf.check.findings import module_label
from lightning_ulysses.hf.check.tensors import (
    backward_hooks_off,
    gradient_probe,
    hooks,
    modes_restored,
    tensors_of,
    zero_gradient_reaches,
)
from lightning_ulysses.hf.plan import Finding

OWN_GRADIENT = (
    "adds a gradient of its own in training (a zero gradient of every output the model returns gives its parameters a "
    "non-zero one: an auxiliary loss that only the backward sees, as DeepSeek-V2's MoE adds its load-balancing loss). "
    "Under sequence parallelism each rank would compute that loss from its shard of the sequence, which differs from "
    "the whole sequence's. Train this model with sp_size=1, or disable the auxiliary loss (e.g. its config's "
    "aux-loss coefficient set to 0, where it has one)"
)


def check_own_gradient(model: PreTrainedModel, input_ids: Tensor, position_ids: Tensor) -> list[Finding]:
    """The modules of ``model`` that add a gradient of their own (see the module docstring), called on
    ``[B, N]`` ``input_ids`` and ``position_ids``: the innermost modules that add one (the model itself where none
    is named). Not collective."""
    names = {module: name for name, module in model.named_modules()}
    outputs_of: dict[nn.Module, list[Tensor]] = {}
    embedded: list[Tensor] = []

    def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        outputs_of.setdefault(module, []).extend(t for t in tensors_of(output) if t.requires_grad)

    def leaf_input(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        output = output if output.requires_grad else output.detach().requires_grad_()
        embedded.append(output)
        return output

    try:
        with (
            modes_restored(model),
            backward_hooks_off(model),
            gradient_probe(input_ids.device),
            checkpointing_off(model),
            sequence_parallel_disabled(model),
            hooks(model, record),
            _forward_hook(model.get_input_embeddings(), leaf_input),
        ):
            model.train()
            output = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            returned = [t for t in tensors_of(output) if t.requires_grad]
            if not zero_gradient_reaches(returned, embedded, retain_graph=True):
                return []
            owners = _owners(model, names, outputs_of)
    except Exception as error:  # noqa: BLE001 - a model whose gradient cannot be probed is refused, with the reason
        problem = f"cannot be run with a gradient in training mode ({type(error).__name__}: {error})"
        return [Finding(type(model).__name__, problem)]
    return [Finding(module_label(names, module), OWN_GRADIENT) for module in owners] or [
        Finding(type(model).__name__, OWN_GRADIENT)
    ]


def _owners(
    model: nn.Module, names: dict[nn.Module, str], outputs_of: dict[nn.Module, list[Tensor]]
) -> list[nn.Module]:
    """The innermost modules that add a gradient of their own: on the recorded graph, a zero gradient of the module's
    own outputs gives its trainable parameters a non-zero one. ``[]`` where the graph cannot tell (an output changed
    in place later, say)."""
    adding = []
    try:
        for module in outputs_of:
            parameters = [p for p in module.parameters() if p.requires_grad]
            if module is model or not parameters:
                continue
            if zero_gradient_reaches(outputs_of[module], parameters, retain_graph=True):
                adding.append(module)
    except Exception:  # noqa: BLE001 - naming is best effort: the model itself is named then
        return []
    inner = [m for m in adding if not any(o is not m and o in adding for o in m.modules())]
    return sorted(inner, key=lambda m: names[m])


@contextmanager
def checkpointing_off(model: nn.Module) -> Iterator[None]:
    """Within the block no transformers layer recomputes its forward in the backward (reentrant checkpointing cannot
    run under :func:`torch.autograd.grad`); the gradients are the same."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    try:
        for m in flagged:
            setattr(m, "gradient_checkpointing", False)  # noqa: B010 - a plain attribute, not nn.Module's
        yield
    finally:
        for m in flagged:
            setattr(m, "gradient_checkpointing", True)  # noqa: B010


@contextmanager
def _forward_hook(module: nn.Module, hook: Any) -> Iterator[None]:
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
