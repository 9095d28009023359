"""Exporting the weights of a checkpoint directory, of any layout or converted, as a Hugging Face model folder.

:func:`export_hf_model` consolidates the fp32 weights of any checkpoint that ``UlyssesStrategy`` saved (DeepSpeed's
``zero_to_fp32`` reads every ZeRO stage and process count) or that :func:`~.convert.convert_checkpoint` wrote into a
``save_pretrained`` folder, offline in one process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from lightning_ulysses.engines import transformers as transformers_engine
from lightning_ulysses.hf import ULYSSES_ATTN_IMPLEMENTATION
from lightning_ulysses.runtime.directory import is_universal_checkpoint, pointer_of, tag_dir
from lightning_ulysses.runtime.integrity import check_integrity


def export_hf_model(
    checkpoint_dir: str | Path, model: PreTrainedModel, output_dir: str | Path, *, prefix: str = "model."
) -> None:
    """Write the weights of a DeepSpeed checkpoint into ``model`` and ``model.save_pretrained(output_dir)``.

    Works from any layout (ZeRO stage, process count) and from converted checkpoints, in one process without
    DeepSpeed's engine. The checkpoint's files are checked whole first.

    Args:
        checkpoint_dir: the directory that ``trainer.save_checkpoint`` or ``ModelCheckpoint`` wrote, or
            :func:`~.convert.convert_checkpoint`.
        model: a model of the trained architecture (e.g. ``AutoModelForCausalLM.from_config(config)``);
            its weights are replaced.
        output_dir: the Hugging Face folder to write (``config.json`` and the weights).
        prefix: the attribute path of ``model`` inside the LightningModule, with a trailing dot
            (``"model."`` for ``self.model = ...``).
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if transformers_engine.attn_implementation(model.config) == ULYSSES_ATTN_IMPLEMENTATION:
        raise ValueError(
            "The model still runs Ulysses attention; its saved config would load only under UlyssesStrategy. "
            "Pass a plain model (e.g. AutoModelForCausalLM.from_config(config)) or call remove_ulysses_attention first."
        )
    check_integrity(checkpoint_dir, pointer_of(checkpoint_dir))
    if is_universal_checkpoint(checkpoint_dir):
        state_dict = _universal_fp32_state_dict(Path(checkpoint_dir))
    else:
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir))
    weights = {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
    if not weights:
        top_level = sorted({key.split(".")[0] for key in state_dict})
        raise ValueError(
            f"No weights under prefix {prefix!r} in {checkpoint_dir}; its top-level names are {top_level}. "
            "Pass prefix='<attribute of the model in your LightningModule>.'."
        )
    model.load_state_dict(weights, strict=True)
    before = _modification_times(Path(output_dir))
    model.save_pretrained(output_dir)
    _apply_umask(Path(output_dir), before)


def _modification_times(folder: Path) -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} if folder.is_dir() else {}


def _apply_umask(folder: Path, before: dict[str, int]) -> None:
    """Give the files that ``save_pretrained`` wrote the permissions of any new file (``0o666`` less the umask:
    ``0o644`` under the usual ``022``): transformers writes the weights through a private temporary file (``0o600``),
    which left them unreadable to the other users of a shared model folder."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file() and before.get(path.name) != path.stat().st_mtime_ns:
            path.chmod(path.stat().st_mode | (0o666 & ~umask))


def _universal_fp32_state_dict(checkpoint_dir: Path) -> dict[str, Tensor]:
    """The full fp32 weights of a converted checkpoint, tied parameters included (as ``zero_to_fp32`` gives them)."""
    folder = tag_dir(checkpoint_dir)
    state_dict = {
        parameter.name: torch.load(parameter / "fp32.pt", map_location="cpu", weights_only=True)["param"]
        for parameter in (folder / "zero").iterdir()
        if parameter.is_dir()
    }
    model_state = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    for tied, source in model_state.get("shared_params", {}).items():
        state_dict[tied] = state_dict[source]
    return state_dict
