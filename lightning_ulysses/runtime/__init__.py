"""What survives a stop: checkpoints saved, checked, loaded and converted; resumes, preemption and failing together.

``UlyssesStrategy`` enters this package at two points, :func:`save_checkpoint` and :func:`load_checkpoint`, and hands
it its loaders (:mod:`.resume`, :mod:`.eval_data`), its signal handling (:mod:`.preemption`) and its per-step checks
(:mod:`.failures`). Modules, one concept each:

======================  ===============================================================================================
:mod:`.directory`       a DeepSpeed checkpoint directory: pointer files, the tag folder, the saved layout and step
:mod:`.integrity`       every file a load would read is whole (CRC-32), checked before loading, split over the ranks
:mod:`.save`            atomic saves, committed on every rank or not at all; the strategy's save entry point
:mod:`.load`            which layouts a checkpoint resumes on; the strategy's load entry point; universal-loader repairs
:mod:`.convert`         any layout to DeepSpeed's universal format, which resumes on any process count and ZeRO stage
:mod:`.export`          the weights of any checkpoint as a Hugging Face ``save_pretrained`` folder
:mod:`.resume`          mid-epoch resume: the training loader skips the batches the weights hold
:mod:`.preemption`      SIGTERM, SLURM's requeue signal and Ctrl-C end a run with a checkpoint at a step boundary
:mod:`.failures`        non-finite losses raised or skipped on every rank alike; the heartbeat that names dead ranks
:mod:`.out_of_memory`   a step out of memory: one line naming the options that would fit the sequence
:mod:`.eval_data`       evaluation and prediction run the same batches on every DP rank, repeats counted once
======================  ===============================================================================================
"""

from lightning_ulysses.runtime.convert import convert_checkpoint
from lightning_ulysses.runtime.directory import is_universal_checkpoint, saved_global_step, saved_layout
from lightning_ulysses.runtime.export import export_hf_model
from lightning_ulysses.runtime.integrity import CorruptCheckpointError, check_integrity
from lightning_ulysses.runtime.load import check_resumable, load_checkpoint
from lightning_ulysses.runtime.save import CheckpointSaveError, save_checkpoint

__all__ = [
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "check_integrity",
    "check_resumable",
    "convert_checkpoint",
    "export_hf_model",
    "is_universal_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "saved_global_step",
    "saved_layout",
]
