"""Shared fixtures: random distributions for the math tests, the embedded models for integration tests."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.support.carriers import CARRIERS, Carrier, FakeEngine, served


def pytest_configure(config: pytest.Config) -> None:
    """Before any worker starts: the embedded GGUF is assembled from its package's chunks once (``assemble()``
    writes the file in place; workers assembling it at once on a clean machine would read each other's half-written
    file)."""
    if not hasattr(config, "workerinput"):  # the controller, or a run without workers
        from edge_sdk.models import embedded_gguf_path

        embedded_gguf_path()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the cores (tests wait on sockets, timers and subprocesses a good part of
    the time; on 2 cores the suite took 510 s with 2 workers, 440 s with 3), at most 4 (each holds the models)."""
    return min(4, (os.cpu_count() or 1) + 1)


#: pytest-xdist's workers share the machine's cores: each worker's torch (OpenMP) and the processes it starts take
#: its share, not every core (threads that spin against each other: `cloud_adapter.local`)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


def distributions(min_size: int = 2, max_size: int = 64) -> st.SearchStrategy[np.ndarray]:
    """Probability vectors (float32, non-negative, summing to 1) with frequent ties and zeros."""
    weights = hnp.arrays(
        np.float32,
        st.integers(min_size, max_size),
        elements=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 100.0, width=32)),
    )
    return weights.filter(lambda w: w.sum() > 0).map(lambda w: (w / w.sum(dtype=np.float64)).astype(np.float32))


def distribution_pairs(min_size: int = 2, max_size: int = 64) -> st.SearchStrategy[tuple[np.ndarray, np.ndarray]]:
    """Two distributions over one vocabulary."""
    return st.integers(min_size, max_size).flatmap(
        lambda n: st.tuples(distributions(n, n), distributions(n, n))
    )


@pytest.fixture(scope="module", params=CARRIERS)
def carrier(request: pytest.FixtureRequest) -> Iterator[Carrier]:
    """Each carrier a session's messages travel, serving the fakes (``tests.support.carriers``)."""
    yield from served(request.param, FakeEngine())


#: a small collaborative-decoding case for the integration tests
PUBLIC_PROMPT = "Question: Which organ is affected?\nOptions:\n(A) heart\n(B) liver\n(C) lung\n(D) kidney\nAnswer: ("
PRIVATE_CONTEXT = "The patient has jaundice, a swollen liver and raised bilirubin after years of alcohol use."


@pytest.fixture(scope="session")
def slm():
    """The embedded Gemma-3 270M in llama.cpp (one thread: in-process tests run the cloud model beside it)."""
    from edge_sdk.backends.llama_cpp import LlamaCppSLM

    return LlamaCppSLM(n_ctx=512, n_threads=1)


@pytest.fixture(scope="session")
def gemma_llm():
    """The embedded Gemma-3 270M in transformers, float32, loaded once for every test module that needs it.

    Modules share it one after another (never two batchers at once); a test that changes the model loads
    its own copy."""
    from cloud_adapter.llm import TransformersLLM

    return TransformersLLM(dtype="fp32")


@pytest.fixture(scope="session")
def loaded_causal_lms(gemma_llm) -> dict[tuple, tuple]:
    """Every ``(model, tokenizer)`` pair transformers loaded in this run, by what was asked (source, dtype, device,
    device map, tensor-parallel plan), starting with ``gemma_llm``'s."""
    from cloud_adapter.hf_loading import resolve_dtype

    return {load_key(gemma_llm.source, resolve_dtype("fp32", "cpu"), "cpu", None, None):
            (gemma_llm.model, gemma_llm.tokenizer)}


def load_key(source, dtype, device: str, device_map: str | None, tp_plan: str | None) -> tuple:
    return source.name, str(source.gguf_path), source.hf_name_or_dir, str(dtype), device, device_map, tp_plan


@pytest.fixture
def models_loaded_once(monkeypatch: pytest.MonkeyPatch, loaded_causal_lms: dict[tuple, tuple]) -> Iterator[None]:
    """A ``TransformersLLM`` the code under test builds gets the run's already loaded weights (``gemma_llm``'s,
    or those an earlier such test loaded) instead of reading the model again (about 8 CPU seconds each).

    For tests that drive a command in this process (a sweep loads both of its models on every call) and never
    change a model (its attention kernel, hooks, module types, mode and vocabulary rows are checked after the test); what each ``TransformersLLM`` keeps
    per generation is its own, as it is per call."""
    from cloud_adapter import llm
    from cloud_adapter.hf_loading import dtype_device, resolve_dtype

    load = llm.load_causal_lm

    def state(model) -> tuple:
        return (model.config._attn_implementation, len(model._forward_pre_hooks), len(model._forward_hooks),
                model.training, sorted({type(module).__name__ for module in model.modules()}),
                tuple(model.get_output_embeddings().weight.shape))

    def load_once(source, *, dtype="auto", device="cpu", device_map=None, tp_plan=None) -> tuple:
        key = load_key(source, resolve_dtype(dtype, dtype_device(device, device_map)), device, device_map, tp_plan)
        if key not in loaded_causal_lms:
            loaded_causal_lms[key] = load(source, dtype=dtype, device=device, device_map=device_map, tp_plan=tp_plan)
            before[key] = state(loaded_causal_lms[key][0])
        return loaded_causal_lms[key]

    before = {key: state(model) for key, (model, _) in loaded_causal_lms.items()}
    monkeypatch.setattr(llm, "load_causal_lm", load_once)
    yield
    for key, (model, _) in loaded_causal_lms.items():
        assert state(model) == before[key], f"a test changed the shared model {key}"


@pytest.fixture(scope="module")
def engine(gemma_llm):
    """An in-process cloud engine over the shared model (one per test module: its transcripts stay apart)."""
    from cloud_adapter.engine import CloudEngine

    return CloudEngine(gemma_llm)


@pytest.fixture(autouse=True)
def root_logger_as_it_was() -> Iterator[None]:
    """A command line's ``main()`` configures the root logger (``logging.basicConfig(force=True)``) with a handler
    on the ``sys.stderr`` of that moment, which pytest closes after the test: a later test's log line then wrote
    "--- Logging error ---" and a traceback into that test's stderr. Each test leaves the root logger's own
    handlers (pytest's capture handlers are subclasses, and pytest removes them itself) and level as it found them.
    """
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in before and type(handler) in (logging.StreamHandler, logging.FileHandler):
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


#: fixtures that load the embedded model (directly, or through the endpoint's adapter and endpoint over it)
EMBEDDED_MODEL_FIXTURES = frozenset({"slm", "gemma_llm", "engine"})


#: the carriers that serve over loopback sockets (a server per module): in the fast lane each suite runs in process
NETWORK_CARRIERS = frozenset({"grpc", "websocket"})


def over_a_network_carrier(item: pytest.Item) -> bool:
    """Whether ``item`` is a case parametrized over a network carrier (a ``*carrier*`` parameter)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any("carrier" in name and value in NETWORK_CARRIERS for name, value in params.items())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that loads the embedded model is ``slow`` too, and so is every case over a network carrier (its
    in-process case stays): the fast lane (``pytest -m "not slow"``) needs no model file, no server and no
    marker to remember. Tests slow for other reasons (tiny transformers models, processes, real clocks) carry
    ``pytest.mark.slow`` themselves."""
    for item in items:
        if (item.get_closest_marker("model") or EMBEDDED_MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
                or over_a_network_carrier(item)):
            item.add_marker(pytest.mark.slow)
