"""``decodeleak`` run in a fresh interpreter, to see which model libraries a command imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_LIBRARIES = ("torch", "transformers", "llama_cpp")
_MARK = "MODEL LIBRARIES LOADED: "


def decodeleak_in_fresh_process(args: list[str]) -> tuple[subprocess.CompletedProcess[str], list[str] | None]:
    """Run ``decodeleak ARGS`` from the repository root: the finished process, and the model libraries it
    had loaded when it returned (``None`` if it never got there)."""
    code = ("import json, sys\nfrom eval_harness.cli.decodeleak import main\n"
            f"code = main({args!r})\n"
            f"print({_MARK!r} + json.dumps([m for m in {MODEL_LIBRARIES!r} if m in sys.modules]))\n"
            "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    marks = [line.removeprefix(_MARK) for line in done.stdout.splitlines() if line.startswith(_MARK)]
    return done, json.loads(marks[-1]) if marks else None
