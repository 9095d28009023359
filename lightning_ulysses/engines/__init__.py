"""The seam between lightning-ulysses and the private parts of the libraries it builds on, one adapter module each.

Every touch of a private name of Lightning (:mod:`~lightning_ulysses.engines.lightning`), DeepSpeed
(:mod:`~lightning_ulysses.engines.deepspeed`), transformers (:mod:`~lightning_ulysses.engines.transformers`) or torch's
FSDP2 / DeviceMesh (:mod:`~lightning_ulysses.engines.fsdp2`) goes through a function here that says why it is needed;
``tests/test_engines.py`` checks that each still exists with the expected signature, so that a release that moves one
fails there, by name, instead of deep inside a fit.
"""
