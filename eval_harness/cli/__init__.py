"""The command lines: ``coveil`` (the demo) and ``decodeleak`` (audits), a module per command."""

from eval_harness.cli.coveil import main

__all__ = ["main"]
