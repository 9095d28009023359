"""The checks the CLI runs on a parsed config before it builds anything or starts a process.

Each refusal is one :class:`ConfigError` that names the key and what to change; the CLI prints it as one line and
exits with status 2. The checkpoint's files are read whole only in the command the user ran (a launcher's ranks leave
that to the strategy, which splits the files among them). The same rules hold inside the processes
(:class:`~lightning_ulysses.UlyssesStrategy`, the data modules, the checkpoint loader), where they would otherwise be
found only after start-up, once per rank.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L

from lightning_ulysses.attention import resolve_attn_implementation
from lightning_ulysses.runtime.directory import POINTER, UNIVERSAL_LATEST, is_universal_checkpoint, saved_global_step
from lightning_ulysses.runtime.integrity import check_integrity, checkpoint_file_problem
from lightning_ulysses.sequence_parallel import SequenceParallelMixin
from lightning_ulysses.topology import SequenceParallelTopology

LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")  # ckpt_path keywords that Lightning resolves itself

DISTRIBUTION_NAMES = {"PIL": "Pillow", "cv2": "opencv-python", "yaml": "PyYAML", "sklearn": "scikit-learn"}
"""``pip install`` names of the modules whose import name differs from it."""

TORCH_BUILD_PACKAGES = ("torchvision", "torchaudio")
"""Built for one torch release and build (CPU, a CUDA version): a plain ``pip install`` may replace the torch that is
installed, so they are offered last among alternatives, with that warning."""


class ConfigError(ValueError):
    """A config that cannot run, found before any process starts; the message names the key and what to change."""


def check_config(subcommand: str | None, config: Any) -> None:
    """Raise :class:`ConfigError` for what the config alone shows cannot run (``config``: the subcommand's
    namespace)."""
    trainer = config.trainer
    strategy_args = _ulysses_init_args(trainer.get("strategy"))
    if strategy_args is not None:
        _check_layout(strategy_args.get("sp_size"), _world_size(trainer.get("devices"), trainer.get("num_nodes")))
        attn = strategy_args.get("attn_implementation")
        if attn not in (None, "auto"):
            try:
                resolve_attn_implementation(attn, "cuda")
            except (ValueError, ImportError) as error:
                raise ConfigError(f"trainer.strategy.init_args.attn_implementation: {error}") from None
    if trainer.get("logger") in (False, None):
        for callback in trainer.get("callbacks") or []:
            if str(getattr(callback, "class_path", "")).endswith(".LearningRateMonitor"):
                raise ConfigError(
                    "trainer.logger=false, but trainer.callbacks has a LearningRateMonitor, which logs through a "
                    "logger: keep a logger, or remove the LearningRateMonitor from trainer.callbacks."
                )
    _check_split(subcommand, config.get("data"))
    data_args = getattr(config.get("data"), "init_args", None)
    batch_size = data_args.get("batch_size") if data_args is not None else None
    if isinstance(batch_size, int) and batch_size < 1:
        raise ConfigError(
            f"data.batch_size={batch_size}: it is the number of sequences per micro-batch of each data-parallel group "
            "and must be at least 1 (--data.batch_size 1)."
        )
    _check_data_arguments(config.get("data"))
    ckpt_path = config.get("ckpt_path")
    if ckpt_path is not None and ckpt_path not in LIGHTNING_CKPT_NAMES:
        _check_checkpoint(subcommand, Path(ckpt_path), trainer.get("max_steps"))


def run_folder_of(ckpt_path: str | None) -> Path | None:
    """The run folder (``runs/<name>/version_N``, holding ``config.yaml``) of a checkpoint in its ``checkpoints/``."""
    if ckpt_path is None or ckpt_path in LIGHTNING_CKPT_NAMES:
        return None
    folder = Path(ckpt_path).parent
    return folder.parent if folder.name == "checkpoints" and (folder.parent / "config.yaml").is_file() else None


LOADERS = {
    "fit": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


def _check_split(subcommand: str | None, data: Any) -> None:
    """A data module without the loader of the command (e.g. no test split for ``test``) is refused, rather than
    left to fail after start-up."""
    cls = _class_of(getattr(data, "class_path", None))
    method = LOADERS.get(subcommand or "")
    if cls is None or method is None or not issubclass(cls, L.LightningDataModule):
        return
    if getattr(cls, method) is getattr(L.LightningDataModule, method):
        raise ConfigError(
            f"data: {cls.__name__} has no {method}(), so it has no split for {subcommand}. Use a data module that "
            f"defines one, or another command."
        )


def _check_data_arguments(data: Any) -> None:
    """The data module's own check of its values (``check_arguments``, as
    :meth:`~lightning_ulysses.LongTextDataModule.check_arguments` has): a data path or tokenizer folder that does not
    exist, rows too short, found here rather than once per rank after start-up."""
    check = getattr(_class_of(getattr(data, "class_path", None)), "check_arguments", None)
    if check is None:
        return
    try:
        check(data.init_args.as_dict())
    except (ValueError, OSError) as error:
        raise ConfigError(str(error)) from None
    except KeyError:
        return  # a subclass without one of its base's arguments: its own __init__ checks what it has


def _class_of(class_path: Any) -> type | None:
    if not isinstance(class_path, str):
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None  # the parser has already refused what does not import
    return cls if isinstance(cls, type) else None


def _is_a_launched_rank() -> bool:
    """Whether this process is one rank of a job that a launcher started (Lightning's second process, torchrun, a
    multi-task SLURM step), rather than the command the user ran."""
    return "LOCAL_RANK" in os.environ or "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def _ulysses_init_args(strategy: Any) -> Any:
    """The ``init_args`` of a Ulysses strategy (either engine) given as ``class_path``/``init_args``, else ``None``."""
    cls = _class_of(getattr(strategy, "class_path", None))
    return strategy.init_args if cls is not None and issubclass(cls, SequenceParallelMixin) else None


def _world_size(devices: Any, num_nodes: Any) -> int | None:
    """devices x num_nodes, where the config states it (not for ``devices: auto`` or -1, which the machine decides)."""
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    elif isinstance(devices, str) and "," in devices:
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1 or not isinstance(num_nodes, int):
        return None
    return devices * num_nodes


def _check_layout(sp_size: Any, world_size: int | None) -> None:
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or world_size is None:
        return
    try:
        SequenceParallelTopology(world_size, sp_size, 0)
    except ValueError as error:
        raise ConfigError(f"trainer.strategy.init_args.sp_size={sp_size}: {error}") from None


def check_checkpoint_file(ckpt_path: str | None) -> None:
    """Refuse a ``ckpt_path`` file that is not a whole checkpoint (``torch.save``'s archive), read without unpickling
    anything; folders (UlyssesStrategy's checkpoints) and Lightning's keywords pass."""
    if ckpt_path is None or ckpt_path in LIGHTNING_CKPT_NAMES or not Path(ckpt_path).is_file():
        return
    if problem := checkpoint_file_problem(Path(ckpt_path)):
        raise ConfigError(
            f"ckpt_path={ckpt_path!r}: {problem}. Give a checkpoint that a run saved, e.g. "
            "runs/<name>/version_N/checkpoints/last.ckpt (under UlyssesStrategy a folder)."
        )


def _check_checkpoint(subcommand: str | None, path: Path, max_steps: Any) -> None:
    if not path.exists():
        raise ConfigError(f"ckpt_path={str(path)!r} does not exist.")
    if not path.is_dir():
        check_checkpoint_file(str(path))
        return
    universal = is_universal_checkpoint(path)
    if universal and subcommand != "fit":
        raise ConfigError(
            f"ckpt_path={str(path)!r} is a converted (universal) checkpoint, which resumes fit only. {subcommand} "
            "from the checkpoint as saved (on its own process count and ZeRO stage), or export it "
            "(lightning-ulysses export)."
        )
    if not _is_a_launched_rank():  # each rank of a launched job would read every file; the strategy's check splits them
        try:
            check_integrity(path, UNIVERSAL_LATEST if universal else POINTER)
        except (ValueError, OSError) as error:
            raise ConfigError(f"ckpt_path: {error}") from None
    if subcommand == "fit" and isinstance(max_steps, int) and max_steps >= 0:
        step = saved_global_step(path)
        if step >= max_steps:
            raise ConfigError(
                f"ckpt_path={str(path)!r} was saved at global step {step} and trainer.max_steps={max_steps}: nothing "
                f"is left to train. To train on, raise the limit, e.g. --trainer.max_steps {max(2 * step, step + 1)}."
            )


def missing_package(error: BaseException) -> ConfigError | None:
    """The refusal for building a class that failed on an optional package that is not installed (e.g. an image
    processor without Pillow), naming the ``pip install`` to run; ``None`` for any other error.

    Found in the error's chain (jsonargparse wraps the error of a class it builds): a ``ModuleNotFoundError`` of a
    module, or transformers' list of the packages of which any one would do (``Missing optional dependencies: ...``).
    The chain is read from its first error (the wrappers' messages quote it).
    """
    for cause in reversed(list(_chain(error))):
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            module = cause.name.split(".")[0]
            return _install(str(cause), [DISTRIBUTION_NAMES.get(module, module)])
        if match := re.search(r"Missing optional dependencies: ([^.]+)\.", str(cause)):
            what = str(cause).split(". ")[0]
            return _install(what, [name.strip() for name in match.group(1).split(",")])
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__


def _install(what: str, packages: list[str]) -> ConfigError:
    """``packages``: alternatives, any one of which is enough; the first that needs no particular torch build is
    offered."""
    package = sorted(packages, key=lambda name: name.lower() in TORCH_BUILD_PACKAGES)[0]
    missing = f"{package} is not installed" if len(packages) == 1 else f"none of {', '.join(packages)} is installed"
    build = (
        f" (the {package} build that matches your torch: a plain pip install may replace torch)"
        if package.lower() in TORCH_BUILD_PACKAGES
        else ""
    )
    return ConfigError(f"{what}: {missing}. Install it: pip install {package}{build}")
