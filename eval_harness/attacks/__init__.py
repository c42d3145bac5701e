"""Attacks a curious cloud can mount on what it observed (DecodeLeak's second stage)."""
