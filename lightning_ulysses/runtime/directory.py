"""A DeepSpeed checkpoint directory: the pointer file, the tag folder it names, and what its model-states file says.

Layout, as ``UlyssesStrategy`` saves it (:mod:`.save`) and :func:`~.convert.convert_checkpoint` writes it::

    <checkpoint>/latest                      the tag of the committed save (``latest_universal`` once converted)
    <checkpoint>/<tag>/*model_states.pt      Lightning's state, DeepSpeed's counters and layout (ZeRO 1/2: the weights)
    <checkpoint>/<tag>/*optim_states.pt      each rank's ZeRO partition of the fp32 weights and optimizer state
    <checkpoint>/<tag>/zero/<parameter>/     converted: each parameter's full fp32 weight and optimizer state tensors
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

POINTER = "latest"  # DeepSpeed's file naming the tag folder of a checkpoint directory
UNIVERSAL_LATEST = "latest_universal"  # DeepSpeed's pointer to the tag folder of a universal checkpoint
UNTRAINED_STATE_FILE = "untrained_state.pt"  # frozen parameters and persistent buffers of a converted checkpoint


def read_pointer(checkpoint_dir: str | Path, pointer: str = POINTER) -> str:
    """The tag folder that a pointer file (``latest``, or ``latest_universal`` once converted) names."""
    return (Path(checkpoint_dir) / pointer).read_text().strip()


def is_universal_checkpoint(checkpoint_dir: str | Path) -> bool:
    """Whether ``checkpoint_dir`` was written by :func:`~.convert.convert_checkpoint` (DeepSpeed's universal format)."""
    return (Path(checkpoint_dir) / UNIVERSAL_LATEST).is_file()


def pointer_of(checkpoint_dir: str | Path) -> str:
    """The name of the pointer file that a load of ``checkpoint_dir`` follows: ``latest_universal`` or ``latest``."""
    return UNIVERSAL_LATEST if is_universal_checkpoint(checkpoint_dir) else POINTER


def tag_dir(checkpoint_dir: str | Path) -> Path:
    """The tag folder that ``checkpoint_dir``'s pointer (:func:`pointer_of`) names."""
    return Path(checkpoint_dir) / read_pointer(checkpoint_dir, pointer_of(checkpoint_dir))


def model_states_file(checkpoint_dir: str | Path) -> Path:
    """The tag folder's ``*model_states.pt`` (any of them: every file holds the same metadata)."""
    folder = tag_dir(checkpoint_dir)
    files = sorted(folder.glob("*model_states.pt"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no DeepSpeed *model_states.pt file.")
    return files[0]


def _saved_metadata(checkpoint_dir: str | Path) -> dict[str, Any]:
    # mmap: only the metadata is read, not the weights that ZeRO 1/2 store next to it
    return torch.load(model_states_file(checkpoint_dir), map_location="cpu", mmap=True, weights_only=False)


def saved_layout(checkpoint_dir: str | Path) -> tuple[int, int]:
    """``(num_processes, zero_stage)`` that saved a DeepSpeed checkpoint directory."""
    state = _saved_metadata(checkpoint_dir)
    return int(state["dp_world_size"] * state["mp_world_size"]), int(state["ds_config"]["zero_optimization"]["stage"])


def saved_global_step(checkpoint_dir: str | Path) -> int:
    """The Trainer's ``global_step`` (optimizer steps done) that a DeepSpeed or converted checkpoint directory holds."""
    return int(_saved_metadata(checkpoint_dir)["global_step"])
