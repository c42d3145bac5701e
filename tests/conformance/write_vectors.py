"""Golden vectors of the edge's decide step, written by the Python SDK for the TypeScript SDK to replay.

``python -m tests.conformance.write_vectors`` rewrites ``tests/conformance/vectors.json``;
``tests/edge_sdk/test_conformance_vectors.py`` fails while the committed file differs from a fresh write, so a Python
change that alters a decision, an upload, a ledger entry or an epsilon fails until the vectors are re-written on
purpose (and the TypeScript SDK, whose tests replay them, follows).

Each case runs one generation's decide steps through the SDK's own objects: the
:class:`~edge_sdk.decoding.CollaborativeDecoder` of a policy and settings (its
:class:`~edge_sdk.steps.SLMView` with the ``never_upload`` mask, the public fill of a sparse row, the full-row
request, the full-upload cut, the exposure budget, the accountant, the leakage meter), fed the rows written here.
Randomised policies draw from :class:`RecordedDraws`, a seeded numpy generator that records every draw in the
order the policy consumed it; the TypeScript replay hands the same draws back (it re-implements no generator).

Encoding, so every number round-trips bit for bit: a float32 array is the hex of its little-endian bytes, a
float64 scalar the hex of its 8 big-endian bytes (``"7ff0000000000000"`` is infinity), a uint64 draw 16 hex digits.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.decoding import CollaborativeDecoder
from edge_sdk.privacy.accountant import PrivacyAccountant, ReleaseEvent
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.privacy.masking import never_upload_ids
from edge_sdk.policies import EmbeddingNeighbours, make_policy
from edge_sdk.protocol.signals import CloudUpload
from edge_sdk.testing import TableSLM
from edge_sdk.protocol.wire import CloudDistribution

VECTORS = Path(__file__).with_name("vectors.json")
FORMAT = "coveil-conformance/1"


def f32_hex(values: np.ndarray) -> str:
    """A float32 array as the hex of its little-endian bytes."""
    return np.asarray(values, dtype="<f4").tobytes().hex()


def f64_hex(value: float) -> str:
    """A float64 as the hex of its IEEE-754 big-endian bytes (exact, infinities included)."""
    return struct.pack(">d", float(value)).hex()


class _RecordedBits:
    def __init__(self, owner: RecordedDraws) -> None:
        self._owner = owner

    def random_raw(self, size: int) -> np.ndarray:
        raw = self._owner.generator.bit_generator.random_raw(size)
        self._owner.draws.append(["raw", [f"{int(x):016x}" for x in raw]])
        return raw


class RecordedDraws:
    """A seeded numpy generator that records, in order, every draw a policy takes from it.

    Policies read ``random()`` (a float64 uniform) and ``bit_generator.random_raw(n)`` (64-bit words); anything
    else raises, so a policy that starts drawing otherwise fails here instead of writing vectors nobody can replay.
    """

    def __init__(self, seed: int) -> None:
        self.generator = np.random.default_rng(seed)
        self.bit_generator = _RecordedBits(self)
        self.draws: list[list[Any]] = []

    def random(self, size: None = None) -> float:
        if size is not None:
            raise TypeError("the recorded stream hands out one uniform at a time")
        value = float(self.generator.random())
        self.draws.append(["random", f64_hex(value)])
        return value

    def take(self) -> list[list[Any]]:
        draws, self.draws = self.draws, []
        return draws


@dataclass
class Step:
    """One step's input: the SLM's logits, the cloud's row as sent, and its full row if the edge asks for it."""

    slm_logits: np.ndarray
    cloud: CloudDistribution
    full: np.ndarray


@dataclass
class Case:
    name: str
    policy: str
    params: dict[str, Any]
    mode: str
    vocab_size: int
    steps: list[Step]
    alpha: float = 0.3
    exposure_k: int = 4
    exposure_budget: float | None = None
    max_epsilon: float | None = None
    masked_ids: tuple[int, ...] = ()
    private_content_ids: tuple[int, ...] = ()
    seed: int = 0
    embeddings: np.ndarray | None = None
    #: end-of-generation ids, and the steps on which they are out of the choice (``no_stop``; edge-side the edge
    #: removes them from both rows, cloud-side only the cloud is told)
    stop_ids: tuple[int, ...] = ()
    no_stop_steps: tuple[int, ...] = ()
    #: the delta the ledger states epsilon at (``None``: the policy's own)
    epsilon_delta: float | None = None
    note: str = ""


def _probabilities(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    p = np.exp(z - z.max())
    return (p / p.sum()).astype(np.float32)


def _cloud_row(full: np.ndarray, step: int, top_m: int | None, space: str) -> CloudDistribution:
    """The honest cloud's row of ``full`` (logits in logit space, else probabilities): dense, or its top ``top_m``."""
    if top_m is None:
        return CloudDistribution(step, dense=full)
    probabilities = _probabilities(full) if space == "logit" else None
    return CloudDistribution.sparse_from(step, full, top_m, probabilities=probabilities)


def _rows(rng: np.random.Generator, vocab: int, steps: int, *, spread: float, ties: bool) -> list[np.ndarray]:
    rows = []
    for _ in range(steps):
        logits = (rng.standard_normal(vocab) * spread).astype(np.float32)
        if ties:  # exact ties at the top and inside the pool
            order = np.argsort(-logits, kind="stable")
            logits[order[1]] = logits[order[0]]
            logits[order[3]] = logits[order[2]]
        rows.append(logits)
    return rows


def _steps(rng: np.random.Generator, vocab: int, n: int, space: str, top_m: int | None, *, ties: bool = True,
           lying: bool = False) -> list[Step]:
    slm = _rows(rng, vocab, n, spread=2.0, ties=ties)
    llm = _rows(rng, vocab, n, spread=2.0, ties=ties)
    steps = []
    for t in range(n):
        full = llm[t] if space == "logit" else _probabilities(llm[t])
        cloud = _cloud_row(full, t, top_m, space)
        if lying and t == 1 and top_m is not None:
            # a lying cloud: a sparse row whose ids are not its top, a tail bound below what it left out and a
            # tail mass that does not add up; the edge decides from what was sent, at the public fill
            ids = np.argsort(full, kind="stable")[:top_m][::-1].astype(np.int64)
            values = np.sort(full[ids])[::-1].astype(np.float32)
            cloud = CloudDistribution(t, ids=ids, values=values, tail_bound=float(values[-1]) / 2.0, tail_mass=0.75)
        steps.append(Step(slm[t], cloud, full))
    return steps


def _boundary_steps(rng: np.random.Generator, vocab: int, space: str) -> list[Step]:
    """Two dense rows where one id has the logit 0 in both models (the release's upload objective of that id is
    exactly 0: not uploaded, the rule is ``< 0``), a sparse row whose public fill decides the fused top, and a
    dense row with a probability under DP-Fusion's floor."""
    steps = []
    for t, (slm, llm) in enumerate(zip(_rows(rng, vocab, 2, spread=2.0, ties=False),
                                       _rows(rng, vocab, 2, spread=2.0, ties=False))):
        slm[5] = llm[5] = 0.0
        full = llm if space == "logit" else _probabilities(llm)
        steps.append(Step(slm, CloudDistribution(t, dense=full), full))
    # the cloud sends its top 2 (0.5, 0.1) and leaves 0.4 to 10 ids: the public fill 0.04 (not 0) is what puts the
    # SLM's favourite, an id the cloud left out, above the cloud's own top in the fused row
    llm = np.log(np.array([0.5, 0.1] + [0.04] * (vocab - 2))).astype(np.float32)
    slm = np.log(np.array([0.3, 0.05, 0.5] + [0.15 / (vocab - 3)] * (vocab - 3))).astype(np.float32)
    full = llm if space == "logit" else _probabilities(llm)
    steps.append(Step(slm, _cloud_row(full, 2, 2, space), full))
    # the SLM gives the cloud's favourite (0.9) a probability of 1e-12, under DP-Fusion's floor: the floor decides
    # the private row there, and at a large epsilon the reverse divergence, not the forward one, bounds the weight
    llm = np.log(np.array([0.9] + [0.1 / (vocab - 1)] * (vocab - 1))).astype(np.float32)
    slm = np.log(np.array([1e-12] + [1.0 / (vocab - 1)] * (vocab - 1))).astype(np.float32)
    full = llm if space == "logit" else _probabilities(llm)
    steps.append(Step(slm, CloudDistribution(3, dense=full), full))
    return steps


def _param_sets(policy: str) -> list[dict[str, Any]]:
    return {
        "undefended": [{}, {"temperature": 0.7}],
        "coveil": [{"lam": 1.0, "k": 50}, {"lam": 0.05, "k": 3}, {"lam": 0.0, "k": 2}],
        "cogenesis": [{"b": 3}],
        "dp_logit": [{"epsilon": 1.0, "delta": 1e-5, "upload_k": 5}],
        "dp_fusion": [{"epsilon": 2.0, "upload_k": 5}, {"epsilon": 0.0, "upload_k": 3}, {"epsilon": 20.0, "upload_k": 5}],
        "custext": [{"epsilon": 5.0, "n_neighbours": 3}, {"epsilon": 1.0, "n_neighbours": 3, "mapping": "aggressive"}],
        "ldp_sampler": [{"epsilon": 2.0, "gamma": 2.0}],
        "invisible_ink": [{"epsilon": 10.0, "delta": 1e-6}, {"epsilon": 10.0, "top_k": 3}],
    }[policy]


SPACED = ("undefended", "coveil")  # the policies with a logit space
MODES = {"undefended": ("cloud", "edge"), "coveil": ("cloud", "edge"), "cogenesis": ("cloud",),
         "dp_logit": ("cloud",), "dp_fusion": ("cloud", "edge"), "custext": ("edge",), "ldp_sampler": ("edge",),
         "invisible_ink": ("edge",)}
#: DP policies get an epsilon budget that withholds after a few releases (at a per-token epsilon of at most 2)
MAX_EPSILON = {"dp_logit": 8.0, "ldp_sampler": 4.0, "dp_fusion": 15.0}
#: edge-side cases ask for each token's log-probabilities and its 20 best alternatives (OpenAI's most: every id of
#: a 12-id row, so the masked ones' exclusion shows)
TOP_LOGPROBS = 20


def cases() -> list[Case]:
    """Every policy x mode x space it defines, each with sparse and dense rows, ties, a ``never_upload`` mask,
    an exposure budget, a lying cloud row, and a few steps at a vocabulary of thousands."""
    rng = np.random.default_rng(20260530)
    embeddings = rng.standard_normal((12, 4)).astype(np.float32)
    out: list[Case] = []
    for policy, modes in MODES.items():
        for mode in modes:
            for space in ("prob", "logit") if policy in SPACED else ("prob",):
                for index, params in enumerate(_param_sets(policy)):
                    params = {**params, "space": space} if policy in SPACED else params
                    base = f"{policy}/{mode}/{space}/{index}"
                    extra = {"embeddings": embeddings} if policy == "custext" else {}
                    out.append(Case(f"{base}/sparse", policy, params, mode, 12,
                                    _steps(rng, 12, 4, space, top_m=4), private_content_ids=(1, 5, 7),
                                    seed=len(out), stop_ids=(0, 1, 2), no_stop_steps=(0, 2), **extra))
                    out.append(Case(f"{base}/dense-masked", policy, params, mode, 12,
                                    _steps(rng, 12, 3, space, top_m=None), masked_ids=(0, 3, 4),
                                    private_content_ids=(0, 3), seed=len(out), **extra))
                    out.append(Case(f"{base}/budget-lying", policy, params, mode, 12,
                                    _steps(rng, 12, 4, space, top_m=5, lying=True), exposure_budget=0.5,
                                    max_epsilon=MAX_EPSILON.get(policy) if params.get("epsilon", 0) <= 2 else None,
                                    private_content_ids=(2,), seed=len(out),
                                    note="exposure budget 0.5 over 4 steps; step 1's row lies", **extra))
                    out.append(Case(f"{base}/narrow", policy, params, mode, 12,
                                    _steps(rng, 12, 4, space, top_m=2), private_content_ids=(3, 4), seed=len(out),
                                    exposure_k=2, note="the cloud sends its top 2: omitted ids at the public fill",
                                    **extra))
                    out.append(Case(f"{base}/boundary", policy, params, mode, 12, _boundary_steps(rng, 12, space),
                                    private_content_ids=(5,), exposure_k=2, seed=len(out), **extra))
                    if index == 0 and policy != "custext":
                        out.append(Case(f"{base}/large", policy, params, mode, 1536,
                                        _steps(rng, 1536, 2, space, top_m=64, ties=True), masked_ids=(7, 1535),
                                        exposure_k=20, private_content_ids=(7, 11, 13), seed=len(out)))
    # pure DP stated at a delta > 0: dp-accounting's PLD composition, and the budget withholding on it
    out.append(Case("ldp_sampler/edge/prob/0/pld", "ldp_sampler", _param_sets("ldp_sampler")[0], "edge", 12,
                    _steps(rng, 12, 4, "prob", top_m=4), epsilon_delta=1e-6, max_epsilon=4.5,
                    private_content_ids=(1, 5), seed=len(out),
                    note="the ledger at delta 1e-6: two releases fit max_epsilon 4.5, the third is withheld"))
    return out


#: pure eps-DP releases composed at a delta > 0 (dp-accounting's PLD over binary randomised response): eps(n)
PURE_DP_AT_DELTA = ((0.1, 1e-6), (0.5, 1e-5), (0.73, 1e-7), (1.0, 1e-6), (2.0, 1e-8), (4.0, 1e-6))
PURE_DP_RELEASES = (1, 2, 3, 5, 10, 25, 50, 100, 200, 400)


def pure_dp_vectors() -> list[dict[str, Any]]:
    """``eps(n)`` of ``n`` pure ``eps``-DP releases at each ``delta`` above, as the Python ledger composes them."""
    out = []
    for epsilon, delta in PURE_DP_AT_DELTA:
        accountant = PrivacyAccountant(ReleaseEvent("pure_dp", epsilon), delta=delta)
        out.append({"epsilon": f64_hex(epsilon), "delta": f64_hex(delta),
                    "epsilons": [[n, f64_hex(accountant.epsilon(n))] for n in PURE_DP_RELEASES]})
    return out


def _policy(case: Case) -> Any:
    params = dict(case.params)
    if case.policy == "custext":
        assert case.embeddings is not None
        params["neighbours"] = EmbeddingNeighbours(case.embeddings)
    return make_policy(case.policy, **params)


def _dist_json(dist: CloudDistribution) -> dict[str, Any]:
    if dist.dense is not None:
        return {"dense": f32_hex(dist.dense)}
    return {"ids": [int(i) for i in dist.ids], "values": f32_hex(dist.values), "tail_bound": f64_hex(dist.tail_bound),
            "tail_mass": f64_hex(dist.tail_mass)}


def _event_json(event: Any) -> dict[str, Any]:
    return {"kind": event.kind, "value": f64_hex(event.value), "delta": f64_hex(event.delta),
            "order": None if event.order is None else f64_hex(event.order), "horizon": event.horizon,
            "source_value": None if event.source_value is None else f64_hex(event.source_value)}


def run_case(case: Case) -> dict[str, Any]:
    """Run ``case``'s steps through the SDK's decide step and return the case with what it produced."""
    policy = _policy(case)
    slm = TableSLM([f"<{i}>" for i in range(case.vocab_size)])
    settings = DecodeSettings(mode=case.mode, alpha=case.alpha, max_new_tokens=len(case.steps),
                              exposure_k=case.exposure_k, exposure_budget=case.exposure_budget,
                              max_epsilon=case.max_epsilon, top_m=4,
                              logprobs=TOP_LOGPROBS if case.mode == "edge" else None, epsilon_delta=case.epsilon_delta)
    draws = RecordedDraws(case.seed)
    meter = LeakageMeter(frozenset(case.private_content_ids))
    decoder = CollaborativeDecoder(slm, policy, settings, slm_prompt=[], cloud_prompt=[], meter=meter,
                                   masked_ids=frozenset(case.masked_ids), rng=draws)  # type: ignore[arg-type]
    decoder.stop.open(frozenset(case.stop_ids))
    max_steps = len(case.steps)
    steps = []
    for t, step in enumerate(case.steps):
        no_stop = t in case.no_stop_steps
        pending = decoder._pending_signal(t, max_steps, no_stop=no_stop)
        logits = step.slm_logits
        decoder.view.row = decoder.view.arrays(logits)
        dist = step.cloud
        decision = decoder._decision(dist, pending.withheld, no_stop)
        full_requested = decision is None
        if decision is None:
            dist = CloudDistribution(t, dense=step.full)
            decision = decoder._decision(dist, pending.withheld, no_stop)
            assert decision is not None
        pending.decision = decision
        if not pending.withheld:
            decoder.budget.record_release(t, decision.signal, dist)
        signal = decision.signal
        token = signal.token_id if not isinstance(signal, CloudUpload) else None
        meter.observe(decision.exposure)
        if token is not None:
            meter.observe([token])
        steered = decoder.budget.count_steered(signal, dist)
        epsilon = decoder.accountant.epsilon()
        source = decoder.accountant.source_epsilon()
        expect: dict[str, Any] = {
            "withheld": pending.withheld, "full_requested": full_requested,
            "signal": "upload" if isinstance(signal, CloudUpload) else "token",
            "exposure": [int(i) for i in decision.exposure], "steered": bool(steered),
            "released": t in decoder.accountant.release_steps, "epsilon": f64_hex(epsilon),
            "source_epsilon": None if source is None else f64_hex(source), "leak_share": f64_hex(meter.share),
        }
        if isinstance(signal, CloudUpload):
            expect.update(ids=[int(i) for i in signal.ids], values=f32_hex(signal.values))
        else:
            expect["token_id"] = int(signal.token_id)
        if decision.logprobs is not None:
            read = decision.logprobs()
            expect["logprobs"] = {"logprob": f64_hex(read.logprob), "top": [[i, f64_hex(v)] for i, v in read.top]}
        row: dict[str, Any] = {"slm_logits": f32_hex(logits), "cloud": _dist_json(step.cloud), "no_stop": no_stop,
                               "draws": draws.take(), "expect": expect}
        if policy.space == "prob":
            row["slm_probs"] = f32_hex(_softmax32(logits))
        if full_requested:
            row["full"] = f32_hex(step.full)
        steps.append(row)
        if token is not None:
            decoder.tokens.append(token)
    summary = decoder.accountant.summary()
    return {
        "name": case.name, "note": case.note, "policy": case.policy,
        "params": {key: value for key, value in case.params.items()},
        "describe": policy.describe(), "mode": case.mode, "space": policy.space, "alpha": f64_hex(case.alpha),
        "vocab_size": case.vocab_size, "exposure_k": case.exposure_k, "exposure_budget": case.exposure_budget,
        "max_epsilon": case.max_epsilon, "max_new_tokens": max_steps, "masked_ids": list(case.masked_ids),
        "logprobs": settings.logprobs, "epsilon_delta": case.epsilon_delta,
        "stop_ids": list(case.stop_ids),
        "private_content_ids": list(case.private_content_ids),
        "embeddings": None if case.embeddings is None else {"rows": int(case.embeddings.shape[0]),
                                                            "dim": int(case.embeddings.shape[1]),
                                                            "values": f32_hex(case.embeddings.ravel())},
        "event": _event_json(decoder.accountant.event),
        "steps": steps,
        "expect": {"release_steps": list(decoder.accountant.release_steps),
                   "withheld_from": decoder.accountant.withheld_from,
                   "guarantee": summary["guarantee"], "accountant": summary["accountant"],
                   "delta": f64_hex(summary["delta"]), "event": summary["event"],
                   "epsilon_spent": None if summary["epsilon_spent"] is None else f64_hex(summary["epsilon_spent"]),
                   "steered_steps": decoder.budget.steered_steps},
    }


def _softmax32(logits: np.ndarray) -> np.ndarray:
    """The SLM's probabilities exactly as the view computes them before its mask (the TypeScript replay reads
    these, and checks its own softmax of the logits equals them bit for bit)."""
    from edge_sdk.fusion import softmax

    return softmax(logits)


#: a token table: word pieces the masking rules must find, then every single character its spans can be spelt with
MASKING_PIECES = [" ", ".", ",", "-", "Dr", " Dr", " Li", " li", " LI", "Li", "li", " Mar", " Mari", " Maria", " María",
                  "ia", "ngela", " the", " The", "the", " saw", " patient", " Okonkwo", "Fitzgerald", " Fitzgerald",
                  "Okonkwo", " 王", "王", "小", "明", " 王小明", "í", "Í",
                  *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]
MASKING = [
    {"pieces": MASKING_PIECES,
     "private_context": "Dr. Li saw the patient María Okonkwo-Fitzgerald and 王小明.",
     "cases": [["Dr. Li"], ["Maria"], ["Okonkwo-Fitzgerald"], ["王小明"], ["the patient"], ["Li", "María"]],
     "errors": [["Bob"], ["  "], ["."]]},
]


def masking_vectors() -> list[dict[str, Any]]:
    """``never_upload`` ids over a token table (longest-piece tokenisation), and the spans refused."""
    from edge_sdk.privacy.masking import folded_vocabulary

    out = []
    for table in MASKING:
        slm = TableSLM(table["pieces"])
        piece = slm.pieces.__getitem__
        tokenize = partial(slm.tokenize, add_bos=False)
        vocabulary = folded_vocabulary(piece, slm.vocab_size)
        results = []
        for spans in table["cases"]:
            ids = never_upload_ids(spans, table["private_context"], tokenize, piece, vocabulary)
            results.append({"spans": spans, "ids": sorted(ids)})
        errors = []
        for spans in table["errors"]:
            try:
                never_upload_ids(spans, table["private_context"], tokenize, piece, vocabulary)
            except ValueError as error:
                errors.append({"spans": spans, "error": str(error)})
            else:
                raise AssertionError(f"spans {spans} were accepted")
        out.append({"pieces": table["pieces"], "private_context": table["private_context"], "cases": results,
                    "errors": errors})
    return out


def build() -> dict[str, Any]:
    """The whole vectors document."""
    return {"format": FORMAT, "written_by": "python -m tests.conformance.write_vectors",
            "encoding": {"f32": "hex of little-endian float32 bytes", "f64": "hex of big-endian float64 bytes",
                         "raw": "uint64 words as 16 hex digits"},
            "cases": [run_case(case) for case in cases()], "masking": masking_vectors(),
            "pure_dp_at_delta": pure_dp_vectors()}


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    VECTORS.write_text(render(build()), encoding="utf-8")
    print(f"wrote {VECTORS} ({VECTORS.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
