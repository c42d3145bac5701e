"""Helpers the tests import by module path (``tests.support.tiny_models``); fixtures live in conftest.py files."""
