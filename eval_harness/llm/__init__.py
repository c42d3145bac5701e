"""Clients for language models the harness calls as judges or attackers."""
