"""Command-line flags built from settings dataclasses, for every CLI of the project (llama-cpp-python's
``add_args_from_model`` done for dataclasses).

A settings class writes each option once, as a field: its default, and in the field's ``metadata`` its
``help`` text and any ``argparse`` keywords (``type``, ``metavar``, ``choices``, ``required``).
:func:`add_dataclass_flags` turns the fields into flags and :func:`dataclass_from_args` reads them back.
The number converters and the dtype choices the CLIs share live here too.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

#: the dtypes a transformers model loads in (``auto``: the hardware's choice, see ``cloud_adapter.hf_loading``)
DTYPES = ("auto", "bf16", "fp16", "fp32")


def _integer_from(text: str, least: int, what: str) -> int:
    """``text`` as an integer of at least ``least`` (``what`` it must be, for the message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1 (``argparse`` prints the message on anything else)."""
    return _integer_from(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    return _integer_from(text, 0, "an integer of 0 or more")


def positive_float(text: str) -> float:
    """A real number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def positive_float_or_auto(text: str) -> float | str:
    """A real number above 0, or ``auto``."""
    return text if text == "auto" else positive_float(text)


def flag_name(field_name: str) -> str:
    """``max_new_tokens`` → ``--max-new-tokens``."""
    return "--" + field_name.replace("_", "-")


def add_dataclass_flags(
    target: argparse._ActionsContainer,
    cls: type,
    *,
    names: Collection[str] | None = None,
    flag: Callable[[str], str] = flag_name,
    groups: Mapping[str, argparse._ActionsContainer] | None = None,
    helps: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    show_defaults: bool = True,
) -> None:
    """One flag per field of the dataclass ``cls`` (``names``: only those, in the class's order).

    The flag's default is the field's (or ``defaults[name]``), its help ``metadata["help"]`` (or
    ``helps[name]``) followed by `` (default: VALUE)`` unless the text says ``{default}`` itself (then
    that is filled in) or ``show_defaults`` is off; the rest of the metadata goes to ``add_argument`` as
    is.  A ``bool`` field becomes an on-switch.  ``groups[name]`` starts an argument group at that field
    (later fields go there too); ``flag`` names each flag from its field.
    """
    unknown = set(names or ()) - {spec.name for spec in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    where = target
    for spec in dataclasses.fields(cls):
        if names is not None and spec.name not in names:
            continue
        where = (groups or {}).get(spec.name, where)
        options = dict(spec.metadata)
        text = (helps or {}).get(spec.name, options.pop("help", ""))
        options.pop("help", None)
        if spec.type in ("bool", bool):
            where.add_argument(flag(spec.name), dest=spec.name, action="store_true", help=text)
            continue
        default = (defaults or {}).get(spec.name, spec.default)
        if "{default}" in text:
            text = text.format(default=default)
        elif show_defaults and default is not None and not options.get("required"):
            text += f" (default: {default})"
        where.add_argument(flag(spec.name), dest=spec.name, default=default, help=text, **options)


def dataclass_from_args(cls: type[T], args: argparse.Namespace, names: Collection[str] | None = None,
                        **values: Any) -> T:
    """``cls`` from the parsed flags :func:`add_dataclass_flags` added (``names``: only those; ``values``
    for the other fields)."""
    chosen = [spec.name for spec in dataclasses.fields(cls) if names is None or spec.name in names]  # type: ignore[arg-type]
    return cls(**{name: getattr(args, name) for name in chosen}, **values)


def add_dtype_flag(target: argparse._ActionsContainer, *, default: str, help: str, auto: bool = True) -> None:
    """``--dtype``, one of :data:`DTYPES` (without ``auto`` where a run must name its dtype)."""
    choices = [dtype for dtype in DTYPES if auto or dtype != "auto"]
    target.add_argument("--dtype", default=default, choices=choices, help=help)
