"""Write the plan's JSON Schema to solver/plan/schema/plan.schema.json (run: python -m solver.plan.schema_file)."""

from __future__ import annotations

import json
from pathlib import Path

from solver.plan.record import json_schema

SCHEMA_PATH = Path(__file__).parent / "schema" / "plan.schema.json"


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(schema_text())
    print(f"wrote {SCHEMA_PATH}")
