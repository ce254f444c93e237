# fitplan: template only
"""The per-layer checkpointing module the HF Trainer and accelerate launchers emit when only some layers are
checkpointed (solver/plan/launchers/hf.py `checkpoint_snippet`)."""
# ANN001/ANN201: emitted script code, without annotations (see this package's docstring).
# ruff: noqa: ANN001, ANN201
# fitplan: end template only
# Emitted by fitplan: checkpoint exactly the planned decoder layers (the first ones, whose activations
# live longest). Call after building the model and before training; the emitted configs leave the
# launcher's all-layer checkpointing off, so this mask is what runs.
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
