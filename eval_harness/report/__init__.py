"""Tables (and, to come, plots) from result rows: reads JSONL only, imports no model library."""
