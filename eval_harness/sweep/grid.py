"""Sweep settings: the paper's grids as a shipped config, expanded into settings with stable keys.

A :class:`Setting` is one point of a sweep (fusion mode, policy, its
parameters, alpha, task); its :attr:`Setting.key` is a digest of exactly
those fields, so a result row written today is recognised as done by a
re-run tomorrow, on another machine or in another shard.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from itertools import product
from pathlib import Path
from typing import Any

from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import check_alpha
from edge_sdk.policies import check_params, policy_class
from edge_sdk.protocol.signals import FUSION_MODES

#: the shipped config with the paper's grids (appendix "CoVeil Parameter Settings" and the baselines' ranges)
PAPER_GRIDS = "paper_grids.json"


@dataclass(frozen=True)
class Setting:
    """One point of a sweep.

    Attributes:
        task: the benchmark (``medpriv``, ``commpriv``) or a JSONL path.
        mode: ``"cloud"`` or ``"edge"`` fusion.
        policy: a registered policy name.
        params: the policy's parameters (JSON values only).
        alpha: the fusion weight of the cloud LLM.
    """

    task: str
    mode: str
    policy: str
    params: Mapping[str, Any] = field(default_factory=dict)
    alpha: float = DecodeSettings.alpha

    def __post_init__(self) -> None:
        if self.mode not in FUSION_MODES:
            raise ValueError(f"fusion mode must be one of {FUSION_MODES}, got {self.mode!r}")
        cls = policy_class(self.policy)  # an unknown name fails here, with suggestions
        if self.mode not in cls.modes:
            raise ValueError(f"policy {self.policy!r} does not define {self.mode}-side fusion")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise ValueError(f"fusion weight alpha must be a number, got {self.alpha!r}")
        check_alpha(self.alpha)
        check_params(self.policy, self.params)  # a misspelt or refused parameter fails here, before any model loads
        object.__setattr__(self, "params", dict(sorted(self.params.items())))

    @property
    def key(self) -> str:
        """A stable digest of every field (canonical JSON, sorted keys): equal settings, equal keys."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def label(self) -> str:
        """``"cloud coveil lam=1"``: short and readable, for progress bars and tables."""
        params = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.mode} {self.policy}" + (f" {params}" if params else "")


def load_grids(path: str | Path | None = None) -> dict[str, Any]:
    """A grid config: the shipped paper grids, or a JSON file of the same shape.

    ``{"alpha": 0.3, "cloud": {POLICY: {PARAMETER: [VALUES] or VALUE}}, "edge": {...}}``; keys starting with
    ``_`` are comments.  ``ValueError`` (one line, naming the file) for a file that is not JSON (with its line
    and column) or not of this shape; the settings themselves are checked by :func:`expand`.
    """
    if path is None:
        name = PAPER_GRIDS
        text = resources.files("eval_harness.configs").joinpath(PAPER_GRIDS).read_text(encoding="utf-8")
    else:
        name = str(path)
        text = Path(path).read_text(encoding="utf-8")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None
    if not isinstance(config, dict) or not any(mode in config for mode in FUSION_MODES):
        raise ValueError(f"{name}: a grid config maps 'cloud' and/or 'edge' to policies and their parameter lists")
    for key, value in config.items():
        if key.startswith("_"):
            continue
        if key == "alpha":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}: alpha must be a number, got {value!r}")
        elif key not in FUSION_MODES:
            raise ValueError(f"{name}: unknown key {key!r} (a grid config has alpha, {', '.join(FUSION_MODES)} and "
                             "_comments)")
        elif not isinstance(value, dict) or not all(isinstance(grid, dict) for grid in value.values()):
            raise ValueError(f"{name}: {key} must map each policy to an object of its parameters, "
                             'e.g. {"coveil": {"lam": [0, 1]}, "undefended": {}}')
        elif empty := [f"{policy}.{param}" for policy, grid in value.items() for param, values in grid.items()
                       if values == []]:
            raise ValueError(f"{name}: {key}: {', '.join(empty)} lists no value")
    return config


def expand(
    config: Mapping[str, Any],
    tasks: Sequence[str],
    *,
    modes: Iterable[str] = FUSION_MODES,
    policies: Iterable[str] | None = None,
) -> list[Setting]:
    """Every setting of ``config`` for each task: the product of each policy's parameter lists.

    ``policies`` keeps only those names (all by default).  A parameter given as
    a single value instead of a list is fixed.
    """
    chosen = None if policies is None else set(policies)
    alpha = float(config.get("alpha", DecodeSettings.alpha))
    settings: list[Setting] = []
    for mode in modes:
        for name, grid in config.get(mode, {}).items():
            if chosen is not None and name not in chosen:
                continue
            names = sorted(grid)
            values = [grid[n] if isinstance(grid[n], list) else [grid[n]] for n in names]
            for task, combo in product(tasks, product(*values)):
                try:
                    settings.append(Setting(task, mode, name, dict(zip(names, combo)), alpha))
                except ValueError as exc:  # every setting is checked here, before a sweep reaches it
                    raise ValueError(f"{mode} {name} {_params_text(dict(zip(names, combo)))}: {exc}") from None
    if chosen is not None and (missing := chosen - {s.policy for s in settings}):
        raise ValueError(f"the grid config has no setting for {', '.join(sorted(missing))} in {', '.join(modes)}")
    return settings


def _params_text(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items()) or "(no parameters)"


def sweep_units(settings: Sequence[Setting], items: Mapping[str, Sequence[Any]]) -> list[tuple[Setting, str]]:
    """Every (setting, item id) pair of a sweep, in grid order: each setting with each item of its task."""
    return [(s, item.item_id) for s in settings for item in items[s.task]]


def pending_pairs(
    settings: Sequence[Setting],
    items: Mapping[str, Sequence[Any]],
    done: Container[str],
    shard_of: tuple[int, int] = (0, 1),
    units: Sequence[tuple[Setting, str]] | None = None,
) -> tuple[list[tuple[Setting, str]], int]:
    """Shard ``shard_of``'s (setting, item id) pairs whose row key is not in ``done``, in grid order, and how many
    of its pairs are (``units``: the pairs to consider, default :func:`sweep_units`)."""
    mine = list(shard(sweep_units(settings, items) if units is None else units, *shard_of))
    pending = [(s, item_id) for s, item_id in mine if row_key(s, item_id) not in done]
    return pending, len(mine) - len(pending)


def shard(units: Iterable[tuple[Setting, str]], index: int, count: int) -> Iterator[tuple[Setting, str]]:
    """The (setting, item id) pairs of shard ``index`` of ``count`` (0-based).

    Assignment hashes the pair's key, so it does not depend on the order of
    the grid or of the items, and every pair lands in exactly one shard.
    """
    if not 0 <= index < count:
        raise ValueError(f"shard index must lie in 0..{count - 1}, got {index}")
    for setting, item_id in units:
        if int(row_key(setting, item_id).replace("-", ""), 16) % count == index:
            yield setting, item_id


def row_key(setting: Setting, item_id: str) -> str:
    """The key of one result row: a setting applied to one item."""
    return f"{setting.key}-{hashlib.sha256(item_id.encode()).hexdigest()[:12]}"


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` (1-based i, as people count shards) → ``(i - 1, N)``."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"a shard is i/N, e.g. 2/8, got {text!r}") from None
    if not (count >= 1 and 1 <= index <= count):
        raise ValueError(f"a shard i/N needs 1 <= i <= N, got {text!r}")
    return index - 1, count
