"""Runners: the one decoding loop driven over many items (reference: both models in transformers; deployed:
the llama.cpp edge over gRPC against a cloud adapter, audited from its transcripts)."""
