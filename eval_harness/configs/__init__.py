"""Shipped harness configs (the paper's sweep grids)."""
