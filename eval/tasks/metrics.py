"""Per-sample metrics of the offline tasks that lm-eval's registry lacks, named by a task YAML's
`process_results: NAME` (eval/tasks/__init__.offline_tasks binds them).

json_record   generate_until whose reply must be one JSON record of the task's schema (the schema of its
              `generation_kwargs.so_args`):
                json_valid    1 when the reply parses as strict JSON (json.loads: no raw control characters) and
                              validates against the schema (the jsonschema package), else 0
                field_match   1 when it is valid and every field the document names equals the document's value
"""

from __future__ import annotations

import json


def json_record(doc: dict, results: list[str], schema: dict) -> dict[str, float]:
    import jsonschema
    text = results[0] if results else ""
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema)
    except (ValueError, jsonschema.ValidationError):
        return {"json_valid": 0.0, "field_match": 0.0}
    fields = doc.get("fields", {})
    return {"json_valid": 1.0, "field_match": float(all(value.get(k) == v for k, v in fields.items()))}


METRICS = {"json_record": json_record}
