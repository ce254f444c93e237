# fitplan: template only
"""The entry point the DeepSpeed launcher runs in front of the user's training script when the plan needs more than
ds_config.json can say (solver/plan/launchers/deepspeed.py `entry_point`): torch.compile, and ZeRO-3 leaves for MoE
blocks (issue 35 items 14 and 7)."""
# ANN001/ANN201: emitted script code, without annotations (see this package's docstring).
# ruff: noqa: ANN001, ANN201
# fitplan: end template only
# Emitted by fitplan: `deepspeed ... fitplan_deepspeed.py train.py ARGS` runs your training script (train.py) as
# its __main__, with deepspeed.initialize wrapped so that the engine runs as the plan was priced; your script is
# unchanged. What ds_config.json cannot say:
#   - COMPILE: the plan prices torch.compile of the model; DeepSpeed's config has no switch for it, so the engine
#     deepspeed.initialize returns is compiled (DeepSpeedEngine.compile(), DeepSpeed 0.19).
#   - MOE_LEAVES: a ZeRO-3 plan of an MoE model; DeepSpeed requires each MoE block to be a ZeRO-3 leaf
#     (deepspeed.utils.set_z3_leaf_modules) so that its experts are gathered together whatever the routing picks.
#     An MoE block is a module holding its router (`gate`) and its `experts`, as transformers names them.
import functools
import runpy
import sys

import deepspeed

# fitplan: template only
__COMPILE__ = __MOE_LEAVES__ = False
# fitplan: end template only
COMPILE = __COMPILE__
MOE_LEAVES = __MOE_LEAVES__


def moe_block_classes(model):
    """The classes of the model's MoE blocks: modules with a router `gate` and `experts`."""
    found = {type(m) for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")}
    return sorted(found, key=lambda cls: cls.__name__)


def planned(initialize):
    """deepspeed.initialize, applying what the plan needs around it."""

    @functools.wraps(initialize)
    def wrapped(*args, **kwargs):
        model = kwargs.get("model", args[1] if len(args) > 1 else None)  # initialize(args=None, model=None, ...)
        if MOE_LEAVES:
            classes = moe_block_classes(model) if model is not None else []
            if not classes:
                raise RuntimeError("fitplan: this ZeRO-3 plan is for an MoE model, but the model passed to "
                                   "deepspeed.initialize has no MoE block (a module with `gate` and `experts`)")
            deepspeed.utils.set_z3_leaf_modules(model, classes)
        result = initialize(*args, **kwargs)
        if COMPILE:
            result[0].compile()
        return result

    return wrapped


def main(argv):
    """argv: deepspeed's --local_rank=N (when it passes one), your script, then its arguments."""
    ranks = [a for a in argv if a.startswith("--local_rank")]
    rest = [a for a in argv if not a.startswith("--local_rank")]
    if not rest:
        raise SystemExit("usage: deepspeed ... fitplan_deepspeed.py train.py [its arguments]")
    script, *arguments = rest
    deepspeed.initialize = planned(deepspeed.initialize)
    sys.argv = [script, *ranks, *arguments]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
