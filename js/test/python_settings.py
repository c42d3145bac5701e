"""What the Python SDK says of decode settings, for test/settings.test.ts: DecodeSettings' fields and defaults, and
for each case on stdin (JSON: a list of {"overrides": {...}}) the exception Python raises (its type
and message) or null when Python accepts it.  Prints one JSON object."""

import dataclasses
import json
import sys

from edge_sdk.decode_settings import DecodeSettings


def outcome(case: dict) -> dict | None:
    try:
        DecodeSettings().overridden(**case["overrides"])
    except (TypeError, ValueError) as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return None


fields = [{"name": f.name, "default": f.default} for f in dataclasses.fields(DecodeSettings)]
print(json.dumps({"fields": fields, "outcomes": [outcome(case) for case in json.load(sys.stdin)]}))
