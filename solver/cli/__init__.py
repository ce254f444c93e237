"""The command-line interface: the typer app (`app.py`), one function per command (`commands.py`), options
and their bounds, and the rendering of plans, estimates and reports."""
