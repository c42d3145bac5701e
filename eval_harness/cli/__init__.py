"""The command lines: ``coveil`` (the demo) and ``decodeleak`` (audits), one module each."""

from eval_harness.cli.coveil import main

__all__ = ["main"]
