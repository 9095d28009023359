"""Fine-tuning: chat SFT with the loss on the assistant's tokens only (packed or padded; also on images), and DPO."""

from lightning_ulysses.finetune.dpo import DPO, dpo_loss
from lightning_ulysses.finetune.dpo_data import PreferenceDataModule, PreferenceDataset
from lightning_ulysses.finetune.packing import DataReport, SampleTooLongError, pack_rows
from lightning_ulysses.finetune.records import load_records
from lightning_ulysses.finetune.sft_data import SFTDataModule, SFTDataset
from lightning_ulysses.finetune.templates import TemplateError, tokenize_record
from lightning_ulysses.finetune.tokenizer import byte_chat_tokenizer
from lightning_ulysses.finetune.vision_data import VisionChatDataModule, VisionChatDataset

__all__ = [
    "DPO",
    "DataReport",
    "PreferenceDataModule",
    "PreferenceDataset",
    "SFTDataModule",
    "SFTDataset",
    "SampleTooLongError",
    "TemplateError",
    "VisionChatDataModule",
    "VisionChatDataset",
    "byte_chat_tokenizer",
    "dpo_loss",
    "load_records",
    "pack_rows",
    "tokenize_record",
]
