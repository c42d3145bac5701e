"""Runners: the one decoding loop driven over many items (reference: both models in transformers)."""
