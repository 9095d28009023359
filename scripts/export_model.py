"""Writes a run's last checkpoint as a ``from_pretrained`` folder, with the run's tokenizer beside the weights.

    python scripts/export_model.py runs/sft_quickstart/version_0 runs/sft_model

The run's ``config.yaml`` names the model (a config dict or a local folder) and the tokenizer; any ZeRO stage and
process count (:func:`~lightning_ulysses.export_hf_model`). ``configs/dpo_quickstart.yaml`` starts from this folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from transformers import AutoModelForCausalLM

from lightning_ulysses import export_hf_model
from lightning_ulysses.finetune.tokenizer import load_tokenizer
from lightning_ulysses.model import build_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the run's folder (runs/<name>/version_N)")
    parser.add_argument("output", type=Path, help="the folder to write")
    args = parser.parse_args()
    config = yaml.safe_load((args.run / "config.yaml").read_text())
    model_args, data_args = (config[key].get("init_args", config[key]) for key in ("model", "data"))
    tokenizer = load_tokenizer(data_args["tokenizer"])
    model = AutoModelForCausalLM.from_config(build_config(model_args["model"], len(tokenizer)))
    export_hf_model(args.run / "checkpoints" / "last.ckpt", model, args.output)
    tokenizer.save_pretrained(args.output)


if __name__ == "__main__":
    main()
