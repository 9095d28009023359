"""Converting a checkpoint of any layout to DeepSpeed's *universal* format, which resumes on any layout.

:func:`convert_checkpoint` turns a checkpoint of any layout into a DeepSpeed universal checkpoint: each
trainable parameter's full fp32 weight and optimizer state tensors, one file each, plus the Lightning
state (loops, callbacks, epoch, global step). ``UlyssesStrategy`` resumes it on any process count, ``sp x
dp`` split and ZeRO stage through DeepSpeed's universal loader, with the limits and repairs that
:mod:`.load` states.
"""

from __future__ import annotations

import math
import re
import shutil
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_ulysses.runtime.directory import UNIVERSAL_LATEST, UNTRAINED_STATE_FILE, model_states_file, read_pointer
from lightning_ulysses.runtime.integrity import check_integrity

_GLOBAL_OPTIMIZER_STATE = ("loss_scaler", "dynamic_loss_scale", "overflow")  # fp16 loss scaling, any ZeRO stage


def convert_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path, overwrite: bool = False) -> None:
    """Write a universal copy of a DeepSpeed checkpoint directory, which resumes on any layout.

    Reads every process's ZeRO partitions of the checkpoint (any ZeRO stage and process count, offline in
    one process, holding the full fp32 weights and optimizer state in memory) and writes DeepSpeed's
    universal layout: ``<tag>/zero/<parameter>/{fp32,<state>}.pt`` with the full tensors, ``step.pt``, the
    param groups, and the Lightning state. ``trainer.fit(..., ckpt_path=output_dir)`` under
    :class:`~lightning_ulysses.UlyssesStrategy` then restores it on any process count and ZeRO stage.

    Any optimizer whose state is flat tensors shaped like its parameters (SGD momentum, Adam, AdamW, ...)
    converts; ZeRO-3 resumes Adam's state only (:func:`~.load.check_resumable`). Frozen parameters (e.g. a LoRA
    base model) and persistent buffers, which DeepSpeed's universal loader skips, are kept in one more file
    that :func:`~.load.load_untrained_state` restores.

    Args:
        checkpoint_dir: the directory that ``trainer.save_checkpoint`` or ``ModelCheckpoint`` wrote; its files are
            checked whole first (:func:`~.integrity.check_integrity`).
        output_dir: the directory to write (created; pass it as ``ckpt_path``). Refused if it holds anything, unless
            ``overwrite``; always refused if it is ``checkpoint_dir``, inside it or around it. Its pointer
            (``latest_universal``) is written last, so an interrupted conversion does not load.
        overwrite: replace what ``output_dir`` holds.
    """
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    _check_conversion_output(checkpoint_dir, output_dir, overwrite)
    check_integrity(checkpoint_dir)
    tag = read_pointer(checkpoint_dir)
    model_state = torch.load(model_states_file(checkpoint_dir), map_location="cpu", weights_only=False)
    shapes = {name: shape for group in model_state["param_shapes"] for name, shape in group.items()}
    optim_files = sorted((checkpoint_dir / tag).glob("*zero_pp_rank_*_optim_states.pt"), key=_rank_of)
    if not optim_files:
        raise FileNotFoundError(f"{checkpoint_dir / tag} holds no ZeRO *optim_states.pt file.")
    # parameter -> state ("fp32", "exp_avg", "momentum_buffer", ...) -> its pieces, in rank order
    pieces: dict[str, dict[str, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
    steps: list[Any] = []  # per rank and group: torch's Adam keeps one step per flat group
    for rank, file in enumerate(optim_files):
        saved = torch.load(file, map_location="cpu", weights_only=False)
        flat_state = saved["optimizer_state_dict"]
        if "fp32_flat_groups" in flat_state:
            base_state = flat_state["optimizer_state_dict"]
            partitions = _zero3_partitions(flat_state, base_state, model_state["param_shapes"], rank, len(optim_files))
        else:
            base_state = flat_state["base_optimizer_state"]
            partitions = _zero12_partitions(flat_state, base_state)
        for name, key, piece in partitions:
            pieces[name][key].append(piece)
        steps += [group["step"] for group in base_state["state"].values() if "step" in group]
        if rank == 0:
            param_groups = base_state["param_groups"]
            global_state = {k: flat_state[k] for k in _GLOBAL_OPTIMIZER_STATE if k in flat_state}
            global_state["ds_version"] = saved["ds_version"]
    if any(float(s) != float(steps[0]) for s in steps):
        raise ValueError(f"The optimizer steps of {checkpoint_dir} disagree across partitions: {steps}.")
    step = steps[0] if steps else None

    zero_dir = output_dir / tag / "zero"
    for name, states in pieces.items():
        (zero_dir / name).mkdir(parents=True, exist_ok=True)
        for key, parts in states.items():
            torch.save({"param": torch.cat(parts).view(shapes[name])}, zero_dir / name / f"{key}.pt")
        if step is not None:
            torch.save(step, zero_dir / name / "step.pt")
    # read by the ZeRO 1/2 loader ("param_groups", "ds_version") and the ZeRO-3 one ("optimizer_state_dict")
    torch.save(
        {
            **global_state,
            "param_groups": param_groups,
            "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": param_groups},
        },
        zero_dir / "optimizer_state.pt",
    )
    # the Lightning state and DeepSpeed's counters, under the file name of either engine (ZeRO 1/2 and ZeRO-3)
    client_state = {k: v for k, v in model_state.items() if k not in ("module", "optimizer")}
    for file_name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(client_state, output_dir / tag / file_name)
    untrained = [*model_state["frozen_param_shapes"], *model_state["buffer_names"]]
    if untrained:  # DeepSpeed's universal loader skips them: load_untrained_state restores them
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        whole = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir))
        torch.save({name: whole[name] for name in untrained}, output_dir / tag / UNTRAINED_STATE_FILE)
    (output_dir / UNIVERSAL_LATEST).write_text(tag)


def _check_conversion_output(checkpoint_dir: Path, output_dir: Path, overwrite: bool) -> None:
    """Refuse an output that would overwrite the input, or anything not meant to be replaced."""
    source, target = checkpoint_dir.resolve(), output_dir.resolve()
    if source == target or source in target.parents or target in source.parents:
        raise ValueError(
            f"convert_checkpoint cannot write {output_dir}: it is the checkpoint {checkpoint_dir} being converted, "
            "inside it or around it, whose files the conversion would overwrite or delete while reading them. Write "
            f"the converted checkpoint to a directory of its own, e.g. {str(checkpoint_dir).rstrip('/')}-universal."
        )
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        if not overwrite:
            raise ValueError(
                f"convert_checkpoint will not write into {output_dir}: it exists and is not an empty directory. "
                "Choose a new directory, or pass overwrite=True (--overwrite true) to replace what it holds."
            )
        if output_dir.is_dir():
            shutil.rmtree(output_dir)
        else:
            output_dir.unlink()


def _rank_of(optim_file: Path) -> int:
    match = re.search(r"zero_pp_rank_(\d+)_", optim_file.name)
    if match is None:
        raise ValueError(f"{optim_file} is not named as DeepSpeed names a rank's optimizer states (zero_pp_rank_<N>_).")
    return int(match.group(1))


def _flat_states(base_state: dict[str, Any], group: int, fp32: Tensor) -> Iterator[tuple[str, Any]]:
    """Group ``group``'s fp32 weights and optimizer state tensors (all laid out alike), without the step."""
    yield "fp32", fp32
    for key, value in base_state["state"].get(group, {}).items():
        if key == "step":
            continue
        if not (isinstance(value, Tensor) and value.shape == fp32.shape):
            raise ValueError(
                f"Optimizer state {key!r} is not a flat tensor shaped like the parameters: not convertible"
            )
        yield key, value


def _zero12_partitions(flat_state: dict[str, Any], base_state: dict[str, Any]) -> Iterator[tuple[str, str, Tensor]]:
    """``(parameter, state, piece)``: this rank's piece of each parameter's flat state under ZeRO 1/2, located by
    DeepSpeed's ``param_slice_mappings``; the pieces of all ranks, in rank order, are the whole parameter."""
    for group, fp32 in enumerate(flat_state["single_partition_of_fp32_groups"]):
        for key, flat in _flat_states(base_state, group, fp32):
            for name, address in flat_state["param_slice_mappings"][group].items():
                yield name, key, flat.narrow(0, address.start, address.numel)


def _zero3_partitions(
    flat_state: dict[str, Any],
    base_state: dict[str, Any],
    param_shapes: list[dict[str, Any]],
    rank: int,
    num_ranks: int,
) -> Iterator[tuple[str, str, Tensor]]:
    """As :func:`_zero12_partitions` under ZeRO-3: each parameter of a sub-group holds ``ceil(numel / ranks)``
    elements of each rank's flat partition, in order, the last rank's padded."""
    if flat_state["partition_count"] != num_ranks:
        raise ValueError(f"ZeRO-3 partitions over {flat_state['partition_count']} ranks, but {num_ranks} saved files.")
    for group, fp32 in enumerate(flat_state["fp32_flat_groups"]):
        for key, flat in _flat_states(base_state, group, fp32):
            offset = 0
            for name, shape in param_shapes[group].items():
                numel = math.prod(shape)
                partition = math.ceil(numel / num_ranks)
                kept = max(0, min(partition, numel - rank * partition))
                yield name, key, flat.narrow(0, offset, kept)
                offset += partition
