"""The mLSTM cell (xLSTM): a matrix memory per head, sharded by heads.

``C_t = f_t C_{t-1} + i_t v_t k_t^T``, ``n_t = f_t n_{t-1} + i_t k_t``, ``h_t = C_t q_t / max(|n_t^T q_t|, exp(-m_t))``
for head ``h``, with exponential input gates stabilised by the running maximum ``m_t``: independent across heads,
sequential along the sequence. transformers' ``xLSTMLayer`` projects q, k, v and the input / forget gate
pre-activations per token and hands them, ``[B, H, N, D]`` and ``[B, H, N]``, to its backend module
(``xLSTMBackend``), which dispatches to the mLSTM kernels of its modeling module, held as ``functools.partial``
objects built at construction (the chunkwise kernel in training mode, wrapped to pad to the chunk size in
``"train_with_padding"`` mode; chunkwise plus a recurrent tail for any length in ``"inference"`` mode); the norm,
the output gate and the out-projection after it act per token.

:func:`sharded_mlstm_forward` replaces the backend's forward: the five streams travel in one all-to-all
(:class:`~lightning_ulysses.hf.mixers.core.ShardedCore`, ``[B, N/P, H, 2 D_qk + D_v + 2]`` -> ``[B, N, h, ...]``),
the backend's own forward (its own kernel and mode) runs on the whole sequence of this rank's heads, one row per
document for packed rows (each padded at its end to its length class: causal, the padding never reaches a real
token), and the output travels back. A state handed in (``c_initial``, ...: the xLSTM cache, or the chunked
inference of ``xLSTMModel`` in eval mode when ``max_inference_chunksize`` is below the sequence length) is refused;
the final state the backend returns is gathered over the heads (detached), or ``None`` for packed rows.

Modes: ``"inference"`` (the default, any length) runs so. In ``"train"`` mode the chunkwise kernel takes only
multiples of its chunk size, so the plain model fails on the set-up check's probe (``2 * 11 * sp`` tokens), which
refuses it, naming that error; ``"train_with_padding"`` cannot return the final state that ``xLSTMLayer`` unpacks
(transformers 5.x), and fails the same way.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ulysses.attention import Documents
from lightning_ulysses.groups import SequenceParallelGroups
from lightning_ulysses.hf.mixers.core import ShardedCore

MLSTM_KERNELS = frozenset(
    {
        "mlstm_chunkwise_native_autograd",
        "mlstm_recurrent_sequence_native",
        "mlstm_recurrent_step_native",
        "wrap_chunkwise_pad_zeros",
        "wrap_chunkwise_arbitrary_sequence_length",
    }
)
"""transformers' mLSTM kernel functions (``models/xlstm/modeling_xlstm.py``)."""

STREAMS = ("query", "key", "value", "igate", "fgate")
"""The backend's per-token arguments: q, k ``[B, H, N, D_qk]``, v ``[B, H, N, D_v]``, the gates ``[B, H, N]``."""

INITIAL_STATES = ("c_initial", "n_initial", "m_initial")


def mlstm_kernels_held(module: nn.Module) -> set[str]:
    """The names of the mLSTM kernel functions among ``module``'s attributes, inside ``functools.partial`` objects
    (as function or keyword argument) included."""
    found, pending = set(), [value for value in vars(module).values() if callable(value)]
    while pending:
        function = pending.pop()
        if isinstance(function, functools.partial):
            pending += [function.func, *(v for v in function.keywords.values() if callable(v))]
        elif getattr(function, "__name__", None) in MLSTM_KERNELS:
            found.add(function.__name__)
    return found


def is_mlstm_backend(module: nn.Module) -> bool:
    """A module whose forward takes the mLSTM streams (:data:`STREAMS`) and that holds mLSTM kernels to run them."""
    if not mlstm_kernels_held(module):
        return False
    parameters = inspect.signature(type(module).forward).parameters
    return all(name in parameters for name in STREAMS)


def sharded_mlstm_forward(
    module: nn.Module, group: Callable[[], SequenceParallelGroups], documents: Callable[[], Documents | None]
) -> Callable[..., Any]:
    """The backend's forward on this rank's ``[B, H, N/P, ...]`` streams, computed on the whole sequence for this
    rank's heads (see the module docstring); returns what the backend returns, ``h [B, H, N/P, D_v]`` or
    ``(h, (c, n, m))`` with the final state of every head."""
    forward = module.forward
    signature = inspect.signature(forward)

    def sharded(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        states = [name for name in INITIAL_STATES if bound.arguments.get(name) is not None]
        if states:
            raise ValueError(
                f"{type(module).__name__} under sequence parallelism starts every sequence from an empty state (got "
                f"{', '.join(states)}): train without a cache, and in eval mode keep the config's "
                "max_inference_chunksize at least the sequence length (xLSTMModel otherwise runs each rank's shard in "
                "chunks that carry the state from one to the next)."
            )
        streams = [bound.arguments[name] for name in STREAMS]
        query, key, value, igate, fgate = streams
        core = ShardedCore(group(), query.shape[1], query.shape[1], documents())
        # [B, H, N/P, D] and [B, H, N/P] -> one [B, N/P, H, 2 D_qk + D_v + 2] stream, one all-to-all
        widths = [query.shape[-1], key.shape[-1], value.shape[-1], 1, 1]
        joined = torch.cat([query, key, value, igate.unsqueeze(-1), fgate.unsqueeze(-1)], dim=-1).transpose(1, 2)
        returns_state = []

        def on_rows(rows: Tensor) -> tuple[Tensor, Any]:  # [b, n, h, 2 D_qk + D_v + 2], whole rows or documents
            parts = torch.split(rows.transpose(1, 2), widths, dim=-1)
            call = dict(bound.arguments)
            for name, part, stream in zip(STREAMS, parts, streams):
                call[name] = (part if stream.dim() == 4 else part.squeeze(-1)).to(stream.dtype)
            result = forward(**call)
            returns_state.append(isinstance(result, tuple))
            h, state = result if returns_state[-1] else (result, None)
            return h.transpose(1, 2), state

        h, state = core.run(on_rows, core.scatter(joined))
        h = core.gather(h).transpose(1, 2)
        if not returns_state[0]:
            return h
        return h, None if state is None else tuple(core.gather_state(s) for s in state)

    return sharded
