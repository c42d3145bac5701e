"""Tables and plots from result rows: reads JSONL only, imports no model library."""
