"""The Python files fitplan emits, kept as real modules so that ruff lints them and tests import them.

Each template is what the emitter writes, less its template-only lines: those between `# fitplan: template only`
and `# fitplan: end template only` (imports of what the emitted script defines in another part, the placeholders'
defaults, lint settings). An upper-case `__NAME__` is a placeholder the emitter fills with the plan's value
(`solver.plan.launchers.templating`). train_fitplan.py is emitted as one module, the parts train_fitplan.py,
training_data.py, memory_savers.py, pipeline_stages.py and train_main.py joined in that order; fitplan_torchtitan.py,
fitplan_checkpointing.py and fitplan_deepspeed.py are emitted alone.

The emitted files carry no type annotations (ruff ANN001/ANN201 off in each template): they are user-facing script
code, kept byte for byte as fitplan emitted it before it moved here (tests/solver/template_golden.py).
"""
