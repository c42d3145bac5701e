"""Decoding-time defences, one small class each, behind one registry.

>>> from edge_sdk.policies import make_policy
>>> make_policy("coveil", lam=2.0).describe()
'coveil(lam=2.0, k=50)'

Each policy class wraps pure numpy functions (``coveil_upload``,
``coveil_select``, the baselines' mechanisms) that the SDK, the cloud adapter
and the harness all share.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from edge_sdk.backends.base import SLMBackend
from edge_sdk.policies.base import Policy, UnsupportedModeError
from edge_sdk.protocol.signals import FusionMode
from edge_sdk.policies.cogenesis import CoGenesis
from edge_sdk.policies.coveil import CoVeil, coveil_select, coveil_upload
from edge_sdk.policies.custext import CusText, EmbeddingNeighbours, TokenClusters, load_token_embeddings
from edge_sdk.policies.dp_fusion import DPFusion
from edge_sdk.policies.dp_logit import DPLogit
from edge_sdk.policies.invisible_ink import InvisibleInk
from edge_sdk.policies.ldp_sampler import LDPSampler
from edge_sdk.policies.undefended import Undefended
from edge_sdk.registry import Registry

#: every registered defence, by its ``name``
POLICIES: Registry[type[Policy]] = Registry("policy")


def register_policy(cls: type[Policy], *, force: bool = False) -> type[Policy]:
    """Add a policy class under ``cls.name`` (usable as a class decorator)."""
    return POLICIES.register(cls.name, cls, force=force)  # type: ignore[return-value]


def available_policies(mode: FusionMode | None = None) -> list[str]:
    """Registered policy names, optionally only those that define ``mode``."""
    return [name for name in POLICIES.names() if mode is None or mode in POLICIES.get(name).modes]


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name`` (:class:`~edge_sdk.registry.UnknownNameError` with suggestions otherwise)."""
    return POLICIES.get(name)


def make_policy(name: str, backend: SLMBackend | None = None, **params: Any) -> Policy:
    """Instantiate a registered policy by name with its parameters.

    With ``backend`` the policy builds itself from the edge model
    (:meth:`Policy.from_backend`), e.g. CusText's embedding neighbours.
    """
    cls = policy_class(name)
    params = {key: _typed(cls, key, value) for key, value in params.items()}
    return cls(**params) if backend is None else cls.from_backend(backend, **params)


def check_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` for the policy ``name``, typed as :func:`make_policy` types them, checked without any model.

    ``ValueError`` (one line) for the first parameter the policy would refuse: a name it has no parameter for
    (with the nearest names it has), a value of the wrong type (:func:`_typed`) or one its constructor refuses
    (:meth:`Policy.check_params`), so a sweep can check every grid setting before it loads a model.
    """
    cls = policy_class(name)
    accepted = [field.name for field in dataclasses.fields(cls) if field.init] if dataclasses.is_dataclass(cls) else []
    for key in params:
        if key not in accepted:
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"policy {name} has no parameter {key!r} ({hint}its parameters: {', '.join(accepted)})")
    typed = {key: _typed(cls, key, value) for key, value in params.items()}
    cls.check_params(**typed)
    return typed


def _typed(cls: type[Policy], name: str, value: Any) -> Any:
    """``value`` for the policy field ``name``, checked against its annotation (``ValueError`` otherwise).

    Parameters arrive from JSON and command lines, where ``true`` or ``1.5`` can stand where an ``int`` is meant
    and would otherwise slip through ``>=`` checks (``True >= 0``) or run as a fractional pool size: an ``int``
    field takes an integer (``2.0`` as 2), a ``float`` field any real number; neither takes a bool or a string.
    Fields of other types, and names the class does not have (its constructor refuses those), pass as they are.
    """
    kind = {field.name: field.type for field in dataclasses.fields(cls)}.get(name) if dataclasses.is_dataclass(
        cls) else None
    if isinstance(kind, str) and kind.endswith(" | None"):  # an optional field: None, or a value of its type
        if value is None:
            return None
        kind = kind.removesuffix(" | None")
    if kind not in ("int", "float", int, float):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{cls.name} parameter {name} must be a number, got {value!r}")
    if kind in ("int", int):
        if not float(value).is_integer():
            raise ValueError(f"{cls.name} parameter {name} must be an integer, got {value!r}")
        return int(value)
    return float(value)


for _cls in (Undefended, CoVeil, CoGenesis, DPLogit, DPFusion, CusText, LDPSampler, InvisibleInk):
    register_policy(_cls)

__all__ = [
    "CoGenesis",
    "CoVeil",
    "CusText",
    "DPFusion",
    "DPLogit",
    "EmbeddingNeighbours",
    "InvisibleInk",
    "POLICIES",
    "LDPSampler",
    "Policy",
    "TokenClusters",
    "Undefended",
    "UnsupportedModeError",
    "available_policies",
    "check_params",
    "coveil_select",
    "coveil_upload",
    "load_token_embeddings",
    "make_policy",
    "policy_class",
    "register_policy",
]
