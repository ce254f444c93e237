"""The plan and what consumes it: the plan record and its JSON Schema, the launcher capability registry, the
launchers' emitters, and the advice a plan carries."""
