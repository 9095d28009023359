"""Checkpoints under sequence parallelism: which layouts resume, conversion to any layout, HF export.

:class:`~lightning_ulysses.UlyssesStrategy` saves DeepSpeed's checkpoint directory (Lightning's
``trainer.save_checkpoint`` / ``ModelCheckpoint``). DeepSpeed is given no SP topology, so ZeRO
partitions parameters and optimizer state over *all* ``dp * sp`` processes and replicates nothing per
SP group. Consequences:

* the ``(sp, dp)`` split is not part of the checkpoint: one saved with ``sp=2 x dp=1`` resumes with
  ``sp=1 x dp=2`` (keep ``dp * micro_batch_size`` to keep the global batch);
* the process count and the ZeRO stage are: DeepSpeed cannot re-partition a checkpoint as saved.
  :func:`check_resumable` refuses such a resume before anything is loaded, and says how to convert it.

:func:`convert_checkpoint` turns a checkpoint of any layout into a DeepSpeed *universal* checkpoint: each
trainable parameter's full fp32 weight and optimizer state tensors, one file each, plus the Lightning
state (loops, callbacks, epoch, global step). ``UlyssesStrategy`` resumes it on any process count, ``sp x
dp`` split and ZeRO stage through DeepSpeed's universal loader: weights, optimizer state and step counters
exactly. Under ZeRO-3 that loader (DeepSpeed 0.19) restores Adam's state only (``exp_avg``, ``exp_avg_sq``,
``step``); other checkpoints resume under ZeRO 1/2, and :func:`check_resumable` says so before loading. What
it gets wrong with several param groups, :func:`repair_zero3_universal_load` puts right after the load.

Resuming reproduces the uninterrupted run, also from a checkpoint saved inside an epoch: the strategy
makes the training loader resumable (:mod:`lightning_ulysses.resume`).

:func:`export_hf_model` consolidates the fp32 weights of any such checkpoint (DeepSpeed's
``zero_to_fp32`` reads every ZeRO stage and process count) into a ``save_pretrained`` folder, offline in
one process.
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
from transformers import PreTrainedModel

from lightning_ulysses.checkpoint_io import POINTER, check_integrity, read_pointer
from lightning_ulysses.hf import ULYSSES_ATTN_IMPLEMENTATION


UNIVERSAL_LATEST = "latest_universal"  # DeepSpeed's pointer to the tag folder of a universal checkpoint
UNTRAINED_STATE_FILE = "untrained_state.pt"  # frozen parameters and persistent buffers of a converted checkpoint
# the optimizer state names DeepSpeed 0.19's ZeRO-3 universal loader restores (stage3.py, "for key in [...]")
_ZERO3_UNIVERSAL_STATE = {"fp32", "exp_avg", "exp_avg_sq", "step"}
_GLOBAL_OPTIMIZER_STATE = ("loss_scaler", "dynamic_loss_scale", "overflow")  # fp16 loss scaling, any ZeRO stage


def is_universal_checkpoint(checkpoint_dir: str | Path) -> bool:
    """Whether ``checkpoint_dir`` was written by :func:`convert_checkpoint` (DeepSpeed's universal format)."""
    return (Path(checkpoint_dir) / UNIVERSAL_LATEST).is_file()


def _model_states_file(checkpoint_dir: Path) -> Path:
    tag = read_pointer(checkpoint_dir, UNIVERSAL_LATEST if is_universal_checkpoint(checkpoint_dir) else POINTER)
    files = sorted((checkpoint_dir / tag).glob("*model_states.pt"))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir / tag} holds no DeepSpeed *model_states.pt file.")
    return files[0]


def saved_layout(checkpoint_dir: str | Path) -> tuple[int, int]:
    """``(num_processes, zero_stage)`` that saved a DeepSpeed checkpoint directory."""
    # mmap: only the metadata is read, not the weights that ZeRO 1/2 store next to it
    state = torch.load(_model_states_file(Path(checkpoint_dir)), map_location="cpu", mmap=True, weights_only=False)
    return int(state["dp_world_size"] * state["mp_world_size"]), int(state["ds_config"]["zero_optimization"]["stage"])


def saved_global_step(checkpoint_dir: str | Path) -> int:
    """The Trainer's ``global_step`` (optimizer steps done) that a DeepSpeed or converted checkpoint directory holds."""
    state = torch.load(_model_states_file(Path(checkpoint_dir)), map_location="cpu", mmap=True, weights_only=False)
    return int(state["global_step"])


def check_resumable(checkpoint_dir: str | Path, num_processes: int, zero_stage: int) -> None:
    """Raise before any state is loaded if ``checkpoint_dir`` cannot be restored exactly on this layout.

    A checkpoint as saved resumes on its own process count and ZeRO stage (any ``sp x dp`` split); a
    converted (universal) one on any layout, except optimizer state that DeepSpeed's ZeRO-3 loader cannot
    restore (see the module docstring).
    """
    if is_universal_checkpoint(checkpoint_dir):
        if zero_stage == 3:
            _check_zero3_universal(Path(checkpoint_dir))
        return
    saved_processes, saved_stage = saved_layout(checkpoint_dir)
    if (saved_processes, saved_stage) == (num_processes, zero_stage):
        return
    converted = f"{str(checkpoint_dir).rstrip('/')}-universal"
    raise ValueError(
        f"The checkpoint {checkpoint_dir} was saved by {saved_processes} processes under ZeRO stage {saved_stage}; "
        f"this run has {num_processes} processes under ZeRO stage {zero_stage}. DeepSpeed partitions the weights and "
        f"optimizer state over every process, so as saved it resumes only with {saved_processes} processes and "
        f"stage={saved_stage} (any sp_size x dp_size split). To resume on this layout with the optimizer state and "
        "loop progress, convert it once (offline, one process) and resume from the converted directory: "
        f"lightning-ulysses convert-checkpoint {checkpoint_dir} {converted} (or lightning_ulysses.convert_checkpoint), "
        f"then ckpt_path={converted!r}."
    )


def _universal_tag_dir(checkpoint_dir: Path) -> Path:
    return checkpoint_dir / read_pointer(checkpoint_dir, UNIVERSAL_LATEST)


def _check_zero3_universal(checkpoint_dir: Path) -> None:
    saved_states = {file.stem for file in (_universal_tag_dir(checkpoint_dir) / "zero").glob("*/*.pt")}
    if saved_states == _ZERO3_UNIVERSAL_STATE:
        return
    raise ValueError(
        f"The converted checkpoint {checkpoint_dir} holds optimizer state {sorted(saved_states - {'fp32'})}. "
        "DeepSpeed's ZeRO-3 universal loader restores only Adam's exp_avg, exp_avg_sq and step "
        "(deepspeedai/DeepSpeed#8608), so ZeRO-3 would not resume it exactly. Resume it under ZeRO stage 1 or 2 "
        "(any process count)."
    )


def repair_zero3_universal_load(optimizer: Any, checkpoint_dir: str | Path) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal loader (0.19) with several param groups.

    * It copies the first group's hyperparameters into every group, which would, e.g., decay the norms and
      biases of the usual no-weight-decay group: each group gets its saved ones back.
    * It gives every group's state one shared ``step`` tensor, which torch's Adam increments in place once per
      group and step, so the bias correction would run ahead: each group gets its own copy.
    """
    for state in optimizer.optimizer.state.values():
        if isinstance(state.get("step"), Tensor):
            state["step"] = state["step"].clone()
    path = _universal_tag_dir(Path(checkpoint_dir)) / "zero" / "optimizer_state.pt"
    saved = torch.load(path, map_location="cpu", weights_only=False)["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"{checkpoint_dir} holds {len(saved)} optimizer param groups, this run's optimizer has "
            f"{len(optimizer.param_groups)}: configure_optimizers must build the groups of the run that saved it."
        )
    for group, saved_group in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def convert_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path, overwrite: bool = False) -> None:
    """Write a universal copy of a DeepSpeed checkpoint directory, which resumes on any layout.

    Reads every process's ZeRO partitions of the checkpoint (any ZeRO stage and process count, offline in
    one process, holding the full fp32 weights and optimizer state in memory) and writes DeepSpeed's
    universal layout: ``<tag>/zero/<parameter>/{fp32,<state>}.pt`` with the full tensors, ``step.pt``, the
    param groups, and the Lightning state. ``trainer.fit(..., ckpt_path=output_dir)`` under
    :class:`~lightning_ulysses.UlyssesStrategy` then restores it on any process count and ZeRO stage.

    Any optimizer whose state is flat tensors shaped like its parameters (SGD momentum, Adam, AdamW, ...)
    converts; ZeRO-3 resumes Adam's state only (:func:`check_resumable`). Frozen parameters (e.g. a LoRA
    base model) and persistent buffers, which DeepSpeed's universal loader skips, are kept in one more file
    that :func:`load_untrained_state` restores.

    Args:
        checkpoint_dir: the directory that ``trainer.save_checkpoint`` or ``ModelCheckpoint`` wrote; its files are
            checked whole first (:func:`~lightning_ulysses.checkpoint_io.check_integrity`).
        output_dir: the directory to write (created; pass it as ``ckpt_path``). Refused if it holds anything, unless
            ``overwrite``; always refused if it is ``checkpoint_dir``, inside it or around it. Its pointer
            (``latest_universal``) is written last, so an interrupted conversion does not load.
        overwrite: replace what ``output_dir`` holds.
    """
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    _check_conversion_output(checkpoint_dir, output_dir, overwrite)
    check_integrity(checkpoint_dir)
    tag = read_pointer(checkpoint_dir)
    model_state = torch.load(_model_states_file(checkpoint_dir), map_location="cpu", weights_only=False)
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
    torch.save({**global_state, "param_groups": param_groups,
                "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": param_groups}},
               zero_dir / "optimizer_state.pt")
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
            f"convert_checkpoint cannot write {output_dir}: it is the checkpoint {checkpoint_dir} being converted, inside "
            "it or around it, whose files the conversion would overwrite or delete while reading them. Write the "
            f"converted checkpoint to a directory of its own, e.g. {str(checkpoint_dir).rstrip('/')}-universal."
        )
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        if not overwrite:
            raise ValueError(
                f"convert_checkpoint will not write into {output_dir}: it exists and is not an empty directory. Choose a "
                "new directory, or pass overwrite=True (--overwrite true) to replace what it holds."
            )
        if output_dir.is_dir():
            shutil.rmtree(output_dir)
        else:
            output_dir.unlink()


def load_untrained_state(module: torch.nn.Module, checkpoint_dir: str | Path) -> None:
    """Copy the frozen parameters and persistent buffers that :func:`convert_checkpoint` kept into ``module``
    (the module DeepSpeed's engine wraps), on every rank alike; DeepSpeed's universal loader skips them."""
    import deepspeed

    checkpoint_dir = Path(checkpoint_dir)
    file = _universal_tag_dir(checkpoint_dir) / UNTRAINED_STATE_FILE
    if not file.is_file():
        return
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    # mmap: every rank of a node reads the same pages instead of holding its own copy (a LoRA base is the whole model);
    # weights_only: the file holds tensors only, and nothing else may run when it is read
    for name, value in torch.load(file, map_location="cpu", mmap=True, weights_only=True).items():
        tensor = tensors[name]
        # a ZeRO-3 partitioned parameter is gathered, set on every rank, and partitioned again
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0, enabled=hasattr(tensor, "ds_id")):
            tensor.data.copy_(value)


def _rank_of(optim_file: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", optim_file.name).group(1))


def _flat_states(base_state: dict[str, Any], group: int, fp32: Tensor) -> Iterator[tuple[str, Any]]:
    """Group ``group``'s fp32 weights and optimizer state tensors (all laid out alike), without the step."""
    yield "fp32", fp32
    for key, value in base_state["state"].get(group, {}).items():
        if key == "step":
            continue
        if not (isinstance(value, Tensor) and value.shape == fp32.shape):
            raise ValueError(f"Optimizer state {key!r} is not a flat tensor shaped like the parameters: not convertible")
        yield key, value


def _zero12_partitions(flat_state: dict[str, Any], base_state: dict[str, Any]) -> Iterator[tuple[str, str, Tensor]]:
    """``(parameter, state, piece)``: this rank's piece of each parameter's flat state under ZeRO 1/2, located by
    DeepSpeed's ``param_slice_mappings``; the pieces of all ranks, in rank order, are the whole parameter."""
    for group, fp32 in enumerate(flat_state["single_partition_of_fp32_groups"]):
        for key, flat in _flat_states(base_state, group, fp32):
            for name, address in flat_state["param_slice_mappings"][group].items():
                yield name, key, flat.narrow(0, address.start, address.numel)


def _zero3_partitions(flat_state: dict[str, Any], base_state: dict[str, Any], param_shapes: list[dict[str, Any]],
                      rank: int, num_ranks: int) -> Iterator[tuple[str, str, Tensor]]:
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


def export_hf_model(
    checkpoint_dir: str | Path, model: PreTrainedModel, output_dir: str | Path, *, prefix: str = "model."
) -> None:
    """Write the weights of a DeepSpeed checkpoint into ``model`` and ``model.save_pretrained(output_dir)``.

    Works from any layout (ZeRO stage, process count) and from converted checkpoints, in one process without
    DeepSpeed's engine. The checkpoint's files are checked whole first.

    Args:
        checkpoint_dir: the directory that ``trainer.save_checkpoint`` or ``ModelCheckpoint`` wrote, or
            :func:`convert_checkpoint`.
        model: a model of the trained architecture (e.g. ``AutoModelForCausalLM.from_config(config)``);
            its weights are replaced.
        output_dir: the Hugging Face folder to write (``config.json`` and the weights).
        prefix: the attribute path of ``model`` inside the LightningModule, with a trailing dot
            (``"model."`` for ``self.model = ...``).
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if model.config._attn_implementation == ULYSSES_ATTN_IMPLEMENTATION:
        raise ValueError(
            "The model still runs Ulysses attention; its saved config would load only under UlyssesStrategy. "
            "Pass a plain model (e.g. AutoModelForCausalLM.from_config(config)) or call remove_ulysses_attention first."
        )
    if is_universal_checkpoint(checkpoint_dir):
        check_integrity(checkpoint_dir, UNIVERSAL_LATEST)
        state_dict = _universal_fp32_state_dict(Path(checkpoint_dir))
    else:
        check_integrity(checkpoint_dir)
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir))
    weights = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
    if not weights:
        top_level = sorted({key.split(".")[0] for key in state_dict})
        raise ValueError(
            f"No weights under prefix {prefix!r} in {checkpoint_dir}; its top-level names are {top_level}. "
            "Pass prefix='<attribute of the model in your LightningModule>.'."
        )
    model.load_state_dict(weights, strict=True)
    model.save_pretrained(output_dir)


def _universal_fp32_state_dict(checkpoint_dir: Path) -> dict[str, Tensor]:
    """The full fp32 weights of a converted checkpoint, tied parameters included (as ``zero_to_fp32`` gives them)."""
    tag_dir = _universal_tag_dir(checkpoint_dir)
    state_dict = {
        folder.name: torch.load(folder / "fp32.pt", map_location="cpu", weights_only=True)["param"]
        for folder in (tag_dir / "zero").iterdir() if folder.is_dir()
    }
    model_state = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    for tied, source in model_state.get("shared_params", {}).items():
        state_dict[tied] = state_dict[source]
    return state_dict
