# fitplan: template only
"""The per-layer checkpointing module the HF Trainer and accelerate launchers emit when only some layers are
checkpointed (solver/plan/launchers/hf.py `checkpoint_snippet`)."""
# ANN001/ANN201: emitted script code, without annotations (see this package's docstring).
# ruff: noqa: ANN001, ANN201
# fitplan: end template only
# Emitted by fitplan: checkpoint exactly the planned decoder layers (the first ones, whose activations
# live longest). The emitted configs leave the launcher's all-layer checkpointing off, so this mask is what runs.
# Run your training script through this file and nothing in it changes: accelerate_launch.sh does
# (`accelerate launch ... fitplan_checkpointing.py train.py`); with the HF Trainer, start it the same way
# (`python fitplan_checkpointing.py train.py ...`, or torchrun/accelerate launch in front). Each Trainer and each
# Accelerator.prepare then gets the planned layers. Or call apply_fitplan_checkpointing(model) yourself, after
# building the model and before training.
import functools
import runpy
import sys

from transformers.modeling_layers import GradientCheckpointingLayer

# fitplan: template only
# checkpoint_snippet writes the plan's decoder-layer count and checkpointed layers in place of these.
__LAYERS__ = 0
__CHECKPOINTED__ = set()
# fitplan: end template only

def apply_fitplan_checkpointing(model):
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False})
    keep = set(range(__LAYERS__)) - __CHECKPOINTED__
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for index, layer in enumerate(layers):
        if index in keep:
            layer.gradient_checkpointing = False


def _planned(model):
    """Apply the plan to `model` if it is a transformers model with decoder layers (else leave it)."""
    if hasattr(model, "activation_checkpointing_enable") and any(
            isinstance(m, GradientCheckpointingLayer) for m in model.modules()):
        apply_fitplan_checkpointing(model)


def install():
    """Apply the planned layers to the model of every Trainer built and every model Accelerator.prepare gets."""
    from accelerate import Accelerator
    from transformers import Trainer

    trainer_init, prepare = Trainer.__init__, Accelerator.prepare

    @functools.wraps(trainer_init)
    def init(self, *args, **kwargs):
        trainer_init(self, *args, **kwargs)
        _planned(self.model)

    @functools.wraps(prepare)
    def prepared(self, *args, **kwargs):
        for each in args:
            _planned(each)
        return prepare(self, *args, **kwargs)

    Trainer.__init__, Accelerator.prepare = init, prepared


def main(argv):
    """argv: your training script, then its arguments; it runs as __main__ with the plan installed."""
    if not argv:
        raise SystemExit("usage: fitplan_checkpointing.py train.py [its arguments]")
    install()
    script, *arguments = argv
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
