"""The SLM's vocabulary (its pieces and ``never_upload``'s folded index) is read once per SLM, for every client
over it, and never keeps an SLM alive."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import edge_sdk.client
from edge_sdk.client import EdgeClient
from edge_sdk.testing import ScriptedCloud, TableSLM

PIECES = ["<eos>", " the", " liver", " is", " swollen", "."]


def table_slm() -> TableSLM:
    return TableSLM(PIECES, {(1,): np.log([0.05, 0.05, 0.75, 0.05, 0.05, 0.05])}, eos_ids={0})


class SlottedSLM:
    """An SLM backend that takes no new attribute (``__slots__``), delegating to a table."""

    __slots__ = ("table",)

    def __init__(self) -> None:
        self.table = table_slm()

    def __getattr__(self, name: str) -> Any:  # the table's methods and attributes
        return getattr(self.table, name)


@pytest.fixture
def folds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The vocabulary sizes ``folded_vocabulary`` was called with, in order."""
    calls: list[int] = []
    real = edge_sdk.client.folded_vocabulary

    def counted(piece: Callable[[int], str], vocab_size: int) -> dict[str, tuple[int, ...]]:
        calls.append(vocab_size)
        return real(piece, vocab_size)

    monkeypatch.setattr(edge_sdk.client, "folded_vocabulary", counted)
    return calls


def clients_over(slm: Any) -> list[EdgeClient]:
    cloud = ScriptedCloud(len(PIECES), [np.log([0.1, 0.45, 0.2, 0.1, 0.1, 0.05])] * 4, eos_ids={0})
    return [EdgeClient(cloud.session, slm=slm) for _ in range(3)]


def test_clients_over_one_slm_read_its_vocabulary_once(folds: list[int]) -> None:
    slm = table_slm()
    readings = [client._vocabulary.result() for client in clients_over(slm)]
    assert folds == [len(PIECES)]
    assert readings[0][1] == readings[2][1] and readings[0][1]["liver"] == (2,)
    clients_over(table_slm())[0]._vocabulary.result()
    assert folds == [len(PIECES)] * 2  # another SLM, another reading


def test_an_slm_that_takes_no_attribute_gets_a_reading_per_client(folds: list[int]) -> None:
    readings = [client._vocabulary.result() for client in clients_over(SlottedSLM())]
    assert folds == [len(PIECES)] * 3
    assert readings[0][1] == readings[1][1]


def test_the_reading_kept_on_an_slm_does_not_keep_it_alive() -> None:
    slm = table_slm()
    clients = clients_over(slm)
    clients[0]._vocabulary.result()
    gone = weakref.ref(slm)
    del slm, clients
    gc.collect()
    assert gone() is None
