"""Every config in ``configs/`` trains: the real CLI on the config itself, shrunk to CPU size, for 2 optimizer steps.

A config keeps everything but its sizes: ZeRO stage, strategy options, model family and features, callbacks,
gradient accumulation and clipping, data pipeline, cluster environment. Its :data:`SHRINK` rule names what
changes: sizes (sequence length, files, validation batches, micro-batches per step: :data:`ACCUMULATE`), GPUs to 2
CPU processes per node (``sp_size`` with them; ``num_nodes`` stays, so the multi-node configs run as 2 simulated
nodes under their own launcher, torchrun or srun's variables), ``32-true`` and ``sdpa`` on CPU, and the local
folders: the Llama-3.1-8B folder becomes a tiny Llama-3 with the same GQA ratio, RoPE scaling and untied
embeddings, saved by ``save_pretrained`` in bf16 beside its tokenizer. Every key a rule names must exist in the
config; every other key is used as written, so a key added to a config is exercised here, and a config added to
``configs/`` without a rule fails with what to add. :data:`VARIANTS` run a config under the ZeRO stages that no
shipped config uses.

Checked for every run, on every rank: 2 optimizer steps of finite losses; every weight changed; weight decay on
exactly the weight matrices (by their gathered shapes) both in the optimizer ``CausalLM.configure_optimizers``
builds on the partitioned model and in the optimizer DeepSpeed runs, and, where the embedding rows of never-seen
tokens get no gradient, those rows shrunk by decay alone; the pretrained weights, before the first step, equal to
the saved ones; random weights drawn with the config's ``initializer_range``; the checkpoint written.
"""

from __future__ import annotations

import math
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from lightning_ulysses.cli import main
from lightning_ulysses.cli.checks import _class_of
from lightning_ulysses.data import find_text_files
from lightning_ulysses.model import CausalLM, build_config
from lightning_ulysses.sp_loaders import fork_can_deadlock
from tests.launch import REPO_ROOT, Launcher, launch
from tests.tiny import gathered_parameters

pytestmark = [pytest.mark.distributed, pytest.mark.cli]

CONFIGS = {path.stem: path for path in sorted((REPO_ROOT / "configs").glob("*.yaml"))}
MODEL_FOLDER, TEXT_FOLDER = "<tiny Llama-3 folder>", "<text folder>"  # filled in by the folders fixture
VLM_FOLDER = "<tiny LLaVA-1.5 folder>"

ON_CPU = {
    "trainer.accelerator": "cpu",
    "trainer.precision": "32-true",
    "trainer.strategy.init_args.attn_implementation": "sdpa",
}


def loading_in_the_ranks(key: str) -> dict[str, int]:
    """``{key: 0}`` where this Python's fork can hang a DataLoader worker (CPython gh-112275). The data modules then
    start their workers from a fork server (``sp_loaders.worker_start_method``; tested in test_data, test_finetune and
    test_vision), and each such worker imports torch afresh, ~4 s of CPU: every config's ranks would pay it."""
    return {key: 0} if fork_can_deadlock() else {}


ACCUMULATE = {"trainer.accumulate_grad_batches": 2}
"""For the configs that accumulate gradients (4 to 16 micro-batches a step on 8 GPUs): 2, so still accumulated. Two
steps of dpo_8gpu's 16 were 32 DPO micro-batches under ZeRO-3, half the time of the launch that runs ten configs."""
LLAMA_3_8B_SHRUNK = {
    **ON_CPU,
    **ACCUMULATE,
    **loading_in_the_ranks("data.num_workers"),
    "trainer.devices": 2,
    "trainer.strategy.init_args.sp_size": 2,
    "trainer.limit_val_batches": 2,
    "model.model": MODEL_FOLDER,
    "data.tokenizer": MODEL_FOLDER,
    "data.paths": [TEXT_FOLDER],
    "data.seq_len": 64,
}
SFT_CHATS = ["examples/data/sft_arithmetic.jsonl"]  # relative to the repository, where the launch runs
DPO_PAIRS = ["examples/data/dpo_arithmetic.jsonl"]
VISION_CHATS = ["examples/data/vlm/chats.jsonl"]
SHRINK: dict[str, dict[str, Any]] = {
    "quickstart": {"data.seq_len": 64, "data.max_files": 24, "trainer.limit_val_batches": 2},
    "sft_quickstart": {"data.init_args.seq_len": 256, "trainer.limit_val_batches": 2},
    "sft_8gpu": {
        **ON_CPU,
        **ACCUMULATE,
        **loading_in_the_ranks("data.init_args.num_workers"),
        "trainer.devices": 2,
        "trainer.strategy.init_args.sp_size": 2,
        "trainer.limit_val_batches": 2,
        "model.init_args.model": MODEL_FOLDER,
        "data.init_args.tokenizer": MODEL_FOLDER,
        "data.init_args.paths": SFT_CHATS,
        "data.init_args.val_paths": SFT_CHATS,
        "data.init_args.seq_len": 512,
        "data.init_args.num_proc": None,
    },
    "dpo_quickstart": {
        "model.init_args.model": MODEL_FOLDER,
        "data.init_args.tokenizer": MODEL_FOLDER,
        "data.init_args.seq_len": 512,
        "trainer.limit_val_batches": 2,
    },
    "dpo_8gpu": {
        **ON_CPU,
        **ACCUMULATE,
        **loading_in_the_ranks("data.init_args.num_workers"),
        "trainer.devices": 2,
        "trainer.strategy.init_args.sp_size": 2,
        "trainer.limit_val_batches": 2,
        "model.init_args.model": MODEL_FOLDER,
        "data.init_args.tokenizer": MODEL_FOLDER,
        "data.init_args.paths": DPO_PAIRS,
        "data.init_args.val_paths": DPO_PAIRS,
        "data.init_args.seq_len": 512,
        "data.init_args.num_proc": None,
        # at DPO's 5e-7 two steps of weight decay are below fp32's resolution, and the check of decay would see none
        "model.init_args.learning_rate": 1.0e-04,
    },
    "vlm_sft_quickstart": {"trainer.limit_val_batches": 2},
    "vlm_sft_8gpu": {
        **ON_CPU,
        **ACCUMULATE,
        **loading_in_the_ranks("data.init_args.num_workers"),
        "trainer.devices": 2,
        "trainer.strategy.init_args.sp_size": 2,
        "trainer.limit_val_batches": 2,
        "model.init_args.model": VLM_FOLDER,
        "data.init_args.processor": VLM_FOLDER,
        "data.init_args.paths": VISION_CHATS,
        "data.init_args.val_paths": VISION_CHATS,
        "data.init_args.media_root": "examples/data/vlm",
        "data.init_args.seq_len": 512,
    },
    "llama8b_1node_zero3": LLAMA_3_8B_SHRUNK,
    "multinode_slurm": LLAMA_3_8B_SHRUNK,
    "multinode_torchrun": LLAMA_3_8B_SHRUNK,
}
"""Config name -> ``{dotted key: value}``: the keys that change when the config runs on 2 CPU processes per node."""
OUTSIDE_THE_LOSS = {
    # LLaVA reads the CLIP tower's hidden states before its final norm, as the real checkpoints do
    "vlm_sft_quickstart": ["model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"],
    # LLaVA-1.5 reads the second-to-last CLIP layer's output (vision_feature_layer -2): the last layer is unused
    "vlm_sft_8gpu": [
        *(
            f"model.vision_tower.encoder.layers.2.{module}.{kind}"
            for module in (
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.q_proj",
                "self_attn.out_proj",
                "layer_norm1",
                "mlp.fc1",
                "mlp.fc2",
                "layer_norm2",
            )
            for kind in ("weight", "bias")
        ),
        "model.vision_tower.post_layernorm.weight",
        "model.vision_tower.post_layernorm.bias",
    ],
}
"""Config name -> the weights that its model computes with outside the loss: no gradient, so unchanged by training."""
OWN_INITIALISATION = ("model.vision_tower.encoder.",)
"""Modules that transformers initialises by their own rule (CLIP's encoder: std scaled by width and depth), not
from the config's ``initializer_range``."""

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "quickstart@zero3": ("quickstart", {"trainer.strategy.init_args.stage": 3}),
    "llama8b_1node_zero3@zero1": ("llama8b_1node_zero3", {"trainer.strategy.init_args.stage": 1}),
    "llama8b_1node_zero3@zero2": ("llama8b_1node_zero3", {"trainer.strategy.init_args.stage": 2}),
}
CASES = {**{name: (name, {}) for name in CONFIGS}, **VARIANTS}
LAUNCHERS: dict[str | None, Launcher] = {
    None: "env",
    "lightning.fabric.plugins.environments.TorchElasticEnvironment": "torchrun",
    "lightning.fabric.plugins.environments.SLURMEnvironment": "slurm",
}
"""The cluster environment a config names (``trainer.plugins``) -> the launcher that starts its processes."""
# Llama 3's chat layout in the tiny tokenizer's own tokens (it has no header tokens); the SFT configs render with it
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}### {{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}### assistant\n{% endif %}"
)
# as in Llama 3: in the vocabulary, never in a text
RESERVED_TOKENS = [f"<|reserved_special_token_{i}|>" for i in range(4)]


# ---------------------------------------------------------------------------------------------
# config -> shrunk config
# ---------------------------------------------------------------------------------------------
def set_key(config: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    """Replace the existing value at ``dotted`` (e.g. ``trainer.strategy.init_args.stage``)."""
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        raise KeyError(
            f"{source} changes {dotted!r}, which the config does not have: update the rule in tests/test_configs.py."
        )
    node[last] = value


def shrunk_config(case: str, run_dir: Path, folders: dict[str, str]) -> dict[str, Any]:
    """The config of ``case`` on 2 CPU processes per node, for 2 optimizer steps, with its run in ``run_dir``."""
    name, overrides = CASES[case]
    config = yaml.safe_load(CONFIGS[name].read_text())
    if name not in SHRINK:
        pytest.fail(
            f"configs/{name}.yaml has no shrink rule: add SHRINK[{name!r}] to tests/test_configs.py, naming the keys "
            "that make it run on 2 CPU processes per node (devices, accelerator, precision, sizes, local folders)."
        )
    for source, rule in ((f"SHRINK[{name!r}]", SHRINK[name]), (f"VARIANTS[{case!r}]", overrides)):
        for dotted, value in rule.items():
            filled = [folders.get(v, v) for v in value] if isinstance(value, list) else folders.get(value, value)
            set_key(config, dotted, filled, source)
    trainer = config["trainer"]
    # 2 optimizer steps, validated and checkpointed after the last one (val_check_interval counts batches)
    trainer["max_steps"] = 2
    trainer["val_check_interval"] = 2 * trainer.get("accumulate_grad_batches", 1)
    trainer["default_root_dir"] = str(run_dir)
    if isinstance(trainer.get("logger"), dict):
        trainer["logger"].setdefault("init_args", {})["save_dir"] = str(run_dir)
    for callback in trainer.setdefault("callbacks", []):
        if "every_n_train_steps" in callback.get("init_args", {}):
            callback["init_args"]["every_n_train_steps"] = 2
    trainer["callbacks"].append({"class_path": f"{__name__}.RunRecorder", "init_args": {"case": case}})
    return config


def launcher_of(config: dict[str, Any]) -> Launcher:
    plugins = config["trainer"].get("plugins")
    class_path = plugins.get("class_path") if isinstance(plugins, dict) else plugins
    if class_path not in LAUNCHERS:
        pytest.fail(f"No launcher for trainer.plugins {class_path!r}: add how it starts its processes to LAUNCHERS.")
    return LAUNCHERS[class_path]


# ---------------------------------------------------------------------------------------------
# in the training processes
# ---------------------------------------------------------------------------------------------
RECORDS: dict[str, dict[str, Any]] = {}


class RunRecorder(L.Callback):
    """Appended to each shrunk config's callbacks: records in ``RECORDS[case]`` what the test checks."""

    def __init__(self, case: str) -> None:
        self.case = case

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Record the weight decay of each parameter at the ``configure_optimizers`` call that builds the run's
        optimizer (under ZeRO-3 the parameters are partitioned then; DeepSpeed gathers small ones before training)."""
        build = pl_module.configure_optimizers

        def recording_build() -> dict[str, Any]:
            built = build()
            names = {id(p): name for name, p in pl_module.model.named_parameters()}
            groups = built["optimizer"].param_groups
            self.decay = {names[id(p)]: group["weight_decay"] for group in groups for p in group["params"]}
            return built

        pl_module.configure_optimizers = recording_build

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        RECORDS[self.case] = {
            "initial": gathered_parameters(pl_module.model, trainer.strategy.zero_stage_3),
            "decay": self.decay,
            "optimizer_decays": [group["weight_decay"] for group in trainer.optimizers[0].param_groups],  # DeepSpeed's
            "losses": [],
        }

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        RECORDS[self.case]["losses"].append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        RECORDS[self.case].update(
            final=gathered_parameters(pl_module.model, trainer.strategy.zero_stage_3),
            global_step=trainer.global_step,
            checkpoint=trainer.checkpoint_callback.last_model_path,
        )


def fit_worker(args: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``lightning-ulysses fit --config <file>`` for each file, in this process; the records of every run."""
    for path in args["configs"]:
        main(["fit", "--config", path])
    return RECORDS


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A few long text files, and a tiny Llama-3.1-8B saved with its tokenizer (byte-level BPE, Llama 3's special
    tokens) as ``from_pretrained`` folders are."""
    from tokenizers import ByteLevelBPETokenizer, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("configs")
    texts = [
        path.read_text(encoding="utf-8", errors="replace")[:4000]
        for path in find_text_files(["stdlib"], "*.py")
        if 8000 < path.stat().st_size < 30000
    ][:8]
    (root / "texts").mkdir()
    for i, text in enumerate(texts):
        (root / "texts" / f"document{i}.txt").write_text(text)

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    backend = ByteLevelBPETokenizer()
    backend.train_from_iterator(texts, vocab_size=400, special_tokens=[bos, eos, *RESERVED_TOKENS], show_progress=False)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, backend.token_to_id(bos))]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = CHAT_TEMPLATE
    model_folder = root / "llama-3.1-8b-tiny"
    tokenizer.save_pretrained(model_folder)
    # Llama-3.1-8B but for its sizes: 32 -> 8 query heads, 8 -> 2 key/value heads; wide enough that ZeRO-3 keeps most
    # matrices partitioned during training as in the full model (DeepSpeed keeps those under 1e5 weights whole)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=320,
        intermediate_size=1120,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_folder)
    return {MODEL_FOLDER: str(model_folder), TEXT_FOLDER: str(root / "texts"), VLM_FOLDER: _tiny_llava(root)}


def _tiny_llava(root: Path) -> str:
    """llava-hf/llava-1.5-7b-hf's layout shrunk (a Llama-2 decoder with head_dim = hidden / heads and no GQA, a
    3-layer CLIP tower read at its second-to-last layer, the GELU projector), saved in bf16 with the LLaVA processor
    of examples/make_vlm_data.py, as a from_pretrained folder."""
    from transformers import AutoConfig, LlavaForConditionalGeneration

    from examples.make_vlm_data import save_llava_processor

    folder = root / "llava-1.5-7b-tiny"
    fields = save_llava_processor(folder)
    config = AutoConfig.for_model(
        "llava",
        image_token_id=fields["image_token_id"],
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        text_config=dict(
            model_type="llama",
            vocab_size=fields["vocab_size"],
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            pad_token_id=256,
        ),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=2,
            image_size=8,
            patch_size=2,
        ),
    )
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


class Runs:
    """The cases, each trained when a test first asks for it. The cases that share a launcher and a process layout
    run one after another in one launch (process start-up dominates), so asking for one trains its whole launch."""

    def __init__(self, root: Path, folders: dict[str, str]) -> None:
        self.cases: dict[str, dict[str, Any]] = {}
        self.launches: dict[tuple[Launcher, int, int], list[str]] = defaultdict(list)
        for case in CASES:
            config = shrunk_config(case, root / case, folders)
            (root / f"{case}.yaml").write_text(yaml.safe_dump(config))
            self.cases[case] = {"name": CASES[case][0], "config": config, "file": str(root / f"{case}.yaml")}
            trainer = config["trainer"]
            self.launches[(launcher_of(config), trainer["num_nodes"], trainer["devices"])].append(case)

    def __getitem__(self, case: str) -> dict[str, Any]:
        """``{"config": the shrunk config, "ranks": the records of every rank}``."""
        if "ranks" not in self.cases[case]:
            (launcher, num_nodes, devices), cases = next(item for item in self.launches.items() if case in item[1])
            files = [self.cases[c]["file"] for c in cases]
            records = launch(
                "tests.test_configs:fit_worker",
                num_nodes * devices,
                {"configs": files},
                num_nodes=num_nodes,
                launcher=launcher,
            )
            for c in cases:
                self.cases[c]["ranks"] = [rank_records[c] for rank_records in records]
        return self.cases[case]


@pytest.fixture(scope="module")
def runs(folders: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"), folders)


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
def test_every_config_has_a_shrink_rule() -> None:
    missing, stale = sorted(set(CONFIGS) - set(SHRINK)), sorted(set(SHRINK) - set(CONFIGS))
    assert not missing, f"configs without a shrink rule: {missing}; add SHRINK entries to tests/test_configs.py"
    assert not stale, f"shrink rules for configs that do not exist: {stale}"


def test_shrink_rules_name_existing_keys(tmp_path: Path) -> None:
    config = shrunk_config("llama8b_1node_zero3@zero1", tmp_path, {})
    assert config["trainer"]["strategy"]["init_args"]["stage"] == 1 and config["trainer"]["accelerator"] == "cpu"
    with pytest.raises(KeyError, match="'trainer.strategy.init_args.sp_sise', which the config does not have"):
        set_key(config, "trainer.strategy.init_args.sp_sise", 2, "SHRINK['x']")


def test_slurm_script_matches_the_slurm_config() -> None:
    """``sbatch configs/slurm_2x8.sh`` asks SLURM for the nodes and tasks that multinode_slurm.yaml's Trainer
    expects (Lightning refuses a mismatch at start-up, after the job waited in the queue)."""
    script = (REPO_ROOT / "configs" / "slurm_2x8.sh").read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, flags=re.MULTILINE))
    trainer = yaml.safe_load(CONFIGS["multinode_slurm"].read_text())["trainer"]
    assert int(sbatch["nodes"]) == trainer["num_nodes"]
    assert int(sbatch["ntasks-per-node"]) == int(sbatch["gpus-per-node"]) == trainer["devices"]


def test_pretrained_weights_take_the_default_dtype(folders: dict[str, str]) -> None:
    """The saved folder is bf16; without a Trainer (or under a strategy whose ``32-true`` casts nothing, as DDP's)
    the loaded model is fp32 all the same, as ``from_config`` builds it: the precision decides, not the checkpoint."""
    module = CausalLM(model=folders[MODEL_FOLDER], pretrained=True)
    module.configure_model()
    assert {p.dtype for p in module.parameters()} == {torch.float32}


def test_a_folder_missing_weights_is_refused(folders: dict[str, str], tmp_path: Path) -> None:
    """transformers initialises a weight the folder lacks at random and only logs it; fine-tuning must not start
    from such a model. One weight removed, one renamed: each named."""
    folder = tmp_path / "damaged"
    shutil.copytree(folders[MODEL_FOLDER], folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.self_attn.q_proj.weights"] = weights.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not hold exactly the weights") as refusal:
        CausalLM(model=str(folder), pretrained=True).configure_model()
    for key in [
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weights",
    ]:
        assert key in str(refusal.value)


@pytest.mark.parametrize("case", CASES)
def test_config_trains_two_steps(runs: Runs, folders: dict[str, str], case: str) -> None:
    config, ranks = runs[case]["config"], runs[case]["ranks"]
    model, trainer = config["model"].get("init_args", config["model"]), config["trainer"]
    assert len(ranks) == trainer["num_nodes"] * trainer["devices"]
    for rank, record in enumerate(ranks):
        where = f"{case}, rank {rank}"
        assert record["global_step"] == 2, where
        losses = record["losses"]
        micro_batches = 2 * trainer.get("accumulate_grad_batches", 1)
        assert len(losses) == micro_batches and all(map(math.isfinite, losses)), (where, losses)
        initial, final = record["initial"], record["final"]
        unchanged = [name for name in initial if torch.equal(initial[name], final[name])]
        assert unchanged == OUTSIDE_THE_LOSS.get(runs[case]["name"], []), f"{where}: weights not updated: {unchanged}"

        # weight decay on exactly the matrices, by their gathered (real) shapes
        expected = {name: model["weight_decay"] if p.dim() >= 2 else 0.0 for name, p in initial.items()}
        assert record["decay"] == expected, f"{where}: weight decay by parameter"
        assert record["optimizer_decays"] == [model["weight_decay"], 0.0], f"{where}: DeepSpeed's param groups"

        if model["pretrained"]:
            placeholder = next(v for k, v in SHRINK[runs[case]["name"]].items() if k.split(".")[-1] == "model")
            module_class = _class_of(config["model"].get("class_path")) or CausalLM
            check_pretrained(
                folders[placeholder], module_class.auto_class, initial, final, where, UNSEEN_TOKENS[placeholder]
            )
        else:  # transformers' initialisation, also when ZeRO-3 partitions the model as it is built
            std = build_config(model["model"]).get_text_config().initializer_range  # a composite's decoder's
            for name, p in initial.items():
                if p.dim() >= 2 and not name.startswith(OWN_INITIALISATION):
                    assert abs(p.std().item() - std) < 0.2 * std, f"{where}: {name} has std {p.std().item():.4f}"
    assert Path(ranks[0]["checkpoint"]).is_dir(), f"{case}: no checkpoint at {ranks[0]['checkpoint']!r}"


UNSEEN_TOKENS = {MODEL_FOLDER: RESERVED_TOKENS, VLM_FOLDER: []}
"""Tokens of each folder's vocabulary that the data never holds (their embedding rows get no gradient)."""


def check_pretrained(
    folder: str,
    auto_class: Any,
    initial: dict[str, torch.Tensor],
    final: dict[str, torch.Tensor],
    where: str,
    unseen_tokens: list[str],
) -> None:
    """Loaded and gathered before the first step: the saved (bf16) weights, in fp32 as ``precision: 32-true`` asks
    (the weights of ``auto_class.from_pretrained`` in one plain process, which maps the file's names to the
    model's). After 2 steps: the embedding rows of ``unseen_tokens``, which never occur and so get no gradient,
    changed by AdamW's weight decay alone, that is, shrank."""
    from transformers import AutoTokenizer

    saved = dict(auto_class.from_pretrained(folder, dtype=torch.bfloat16).named_parameters())
    assert len(saved) == len(load_file(Path(folder) / "model.safetensors")), f"{where}: the file has other weights"
    assert initial.keys() == saved.keys(), where
    for name, p in initial.items():
        assert p.dtype == torch.float32 and torch.equal(p, saved[name].float()), f"{where}: {name} is not as saved"
    if not unseen_tokens:
        return
    reserved = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(unseen_tokens)
    before, after = (weights["model.embed_tokens.weight"][reserved] for weights in (initial, final))
    kept = int((after.abs() >= before.abs()).sum())
    assert kept == 0, f"{where}: {kept} of {before.numel()} embedding weights of unseen tokens did not decay"
