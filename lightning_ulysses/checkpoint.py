"""Checkpoints under sequence parallelism: which layouts resume, and export to Hugging Face.

:class:`~lightning_ulysses.UlyssesStrategy` saves DeepSpeed's checkpoint directory (Lightning's
``trainer.save_checkpoint`` / ``ModelCheckpoint``). DeepSpeed is given no SP topology, so ZeRO
partitions parameters and optimizer state over *all* ``dp * sp`` processes and replicates nothing per
SP group. Consequences:

* the ``(sp, dp)`` split is not part of the checkpoint: one saved with ``sp=2 x dp=1`` resumes with
  ``sp=1 x dp=2`` (keep ``dp * micro_batch_size`` to keep the global batch);
* the process count and the ZeRO stage are: DeepSpeed cannot re-partition the optimizer state.
  :func:`check_resumable` refuses such a resume before anything is loaded, saying how to continue
  (from the exported weights, without the optimizer state).

Resuming reproduces the uninterrupted run from an end-of-epoch checkpoint: the distributed sampler
reseeds with the epoch. A mid-epoch checkpoint needs a resumable data loader (e.g. torchdata's
``StatefulDataLoader``), as with any Lightning strategy.

:func:`export_hf_model` consolidates the fp32 weights of any such checkpoint (DeepSpeed's
``zero_to_fp32`` reads every ZeRO stage and process count) into a ``save_pretrained`` folder, offline in
one process.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from lightning_ulysses.patching import ULYSSES_ATTN_IMPLEMENTATION


def _model_states_file(checkpoint_dir: Path) -> Path:
    tag = (checkpoint_dir / "latest").read_text().strip()
    files = sorted((checkpoint_dir / tag).glob("*model_states.pt"))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir / tag} holds no DeepSpeed *model_states.pt file.")
    return files[0]


def saved_layout(checkpoint_dir: str | Path) -> tuple[int, int]:
    """``(num_processes, zero_stage)`` that saved a DeepSpeed checkpoint directory."""
    # mmap: only the metadata is read, not the weights that ZeRO 1/2 store next to it
    state = torch.load(_model_states_file(Path(checkpoint_dir)), map_location="cpu", mmap=True, weights_only=False)
    return int(state["dp_world_size"] * state["mp_world_size"]), int(state["ds_config"]["zero_optimization"]["stage"])


def check_resumable(checkpoint_dir: str | Path, num_processes: int, zero_stage: int) -> None:
    """Raise before any state is loaded if DeepSpeed cannot restore ``checkpoint_dir`` on this layout."""
    saved_processes, saved_stage = saved_layout(checkpoint_dir)
    if (saved_processes, saved_stage) == (num_processes, zero_stage):
        return
    raise ValueError(
        f"The checkpoint {checkpoint_dir} was saved by {saved_processes} processes under ZeRO stage {saved_stage}; "
        f"this run has {num_processes} processes under ZeRO stage {zero_stage}. DeepSpeed partitions the weights and "
        f"optimizer state over every process, so any sp_size x dp_size split of {saved_processes} processes with "
        f"ZeRO stage {saved_stage} resumes it, but another process count or stage cannot. Resume with "
        f"{saved_processes} processes and stage={saved_stage}, or start a new run on this layout from its weights "
        f"(the optimizer state and loop progress are not carried over): lightning_ulysses.export_hf_model("
        f"{str(checkpoint_dir)!r}, model, folder), then AutoModelForCausalLM.from_pretrained(folder) in your "
        "LightningModule."
    )


def export_hf_model(
    checkpoint_dir: str | Path, model: PreTrainedModel, output_dir: str | Path, *, prefix: str = "model."
) -> None:
    """Write the weights of a DeepSpeed checkpoint into ``model`` and ``model.save_pretrained(output_dir)``.

    Works from any layout (ZeRO stage, process count), in one process without DeepSpeed's engine.

    Args:
        checkpoint_dir: the directory that ``trainer.save_checkpoint`` or ``ModelCheckpoint`` wrote.
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
