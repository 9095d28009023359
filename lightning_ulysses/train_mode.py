"""Train a loaded transformers model in train mode, as one process training it would.

``from_pretrained`` returns its model in eval mode, and Lightning (2.x) trains every module in the mode it finds at the
start of ``fit`` (it only warns "Found N module(s) in eval mode at the start of training"). In eval mode transformers
skips activation checkpointing (a layer checkpoints only while ``self.training``) and dropout, so a pretrained model
would train without the memory options asked for, and not as the same code trains it on one process after
``model.train()``.

:func:`train_loaded_models` runs when a fit is set up (``UlyssesStrategy.setup``, before the model is patched and
handed to DeepSpeed), once: every outermost transformers model of the LightningModule that has trainable parameters and
is wholly in eval mode (the state ``from_pretrained`` leaves) is put in train mode, except its frozen parts (the
submodules whose parameters all have ``requires_grad=False``: a frozen vision tower), which stay in eval. What a recipe
set on purpose is kept: a model with any module in train mode, and a model without trainable parameters (DPO's frozen
reference). Lightning captures these modes before each validation and restores them after it; ``validate``, ``test``
and ``predict`` run in eval mode and switch nothing. To train a loaded model in eval mode all the same, call
``.eval()`` on it in ``on_train_start``.
"""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_ulysses.hf.state import outermost_models


def train_loaded_models(module: nn.Module) -> list[str]:
    """Put every transformers model in ``module`` that has trainable parameters and no module in train mode in train
    mode, its frozen submodules (all parameters ``requires_grad=False``) left in eval; log one line saying what was
    switched. Returns the switched models' names in ``module``."""
    names = {id(sub): name for name, sub in module.named_modules()}
    switched: list[str] = []
    kept: list[str] = []
    for model in outermost_models(module):
        if any(sub.training for sub in model.modules()) or not any(p.requires_grad for p in model.parameters()):
            continue  # modes a recipe set, or a frozen model (a reference)
        frozen = frozen_submodules(model)
        model.train()
        for sub in frozen:
            sub.eval()
        switched.append(f"{names[id(model)] or 'the model'} ({type(model).__name__})")
        kept += [names[id(sub)] for sub in frozen]
    if switched:
        listed = ", ".join(kept[:8]) + (f", ... ({len(kept)} in all)" if len(kept) > 8 else "")
        frozen_note = f"; frozen parts kept in eval mode: {listed}" if kept else ""
        rank_zero_info(
            f"Put {', '.join(switched)} in train mode: loaded in eval mode (as from_pretrained returns a model), it "
            f"would train without dropout or activation checkpointing{frozen_note}. To train in eval mode on purpose, "
            "call .eval() on it in on_train_start."
        )
    return switched


def frozen_submodules(model: nn.Module) -> list[nn.Module]:
    """The outermost submodules of ``model`` that hold parameters, none of them trainable (not ``model`` itself)."""
    found: list[nn.Module] = []
    inner: set[int] = set()
    for sub in model.modules():  # pre-order: a module comes before its submodules
        if sub is model or id(sub) in inner:
            continue
        parameters = list(sub.parameters())
        if parameters and not any(p.requires_grad for p in parameters):
            found.append(sub)
            inner.update(id(m) for m in sub.modules())
    return found
