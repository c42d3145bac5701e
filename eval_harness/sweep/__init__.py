"""Sweeps: settings with stable keys (grid), the append-only JSONL results store (store)."""
