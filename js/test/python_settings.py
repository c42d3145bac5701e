"""What the Python SDK says of decode settings, for test/settings.test.ts: DecodeSettings' fields and defaults, and
for each case on stdin (JSON: a list of {"overrides": {...}} or {"mode": ...}) the exception Python raises (its type
and message) or null when Python accepts it.  Prints one JSON object."""

import dataclasses
import json
import sys

import numpy as np

from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.policies import make_policy


def outcome(case: dict) -> dict | None:
    try:
        if "mode" in case:  # the policy's check of a fusion mode
            p = np.full(4, 0.25, dtype=np.float32)
            make_policy("undefended").decide(case["mode"], p, p, alpha=0.3)
        else:
            DecodeSettings().overridden(**case["overrides"])
    except (TypeError, ValueError) as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return None


fields = [{"name": f.name, "default": f.default} for f in dataclasses.fields(DecodeSettings)]
print(json.dumps({"fields": fields, "outcomes": [outcome(case) for case in json.load(sys.stdin)]}))
