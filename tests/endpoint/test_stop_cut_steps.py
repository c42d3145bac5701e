"""Tokens a stop string cuts from the reply: their log-probabilities, stream chunks and rows on the page go with
them, while the ledger still counts them (the cloud saw them)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edge_sdk.server.openai.protocol import StepReport, TokenLogprob
from edge_sdk.server.serving import ShownSteps, StepOut


def step(text: str, index: int) -> StepOut:
    report = StepReport(step=index, token_id=index, saw="token", values_left=1, values_uploaded=0,
                        full_requested=False, withheld=False, steered=False, bytes_up=1, bytes_down=1,
                        leakage_meter=0.0)
    return StepOut(text, report, TokenLogprob(token=text, logprob=-1.0, bytes=list(text.encode()), top_logprobs=[]))


def shown_steps(pieces: list[str], stops: list[str]) -> tuple[list[StepOut], int]:
    shown = ShownSteps(stops)
    released = [out for index, piece in enumerate(pieces) for out in shown.feed(step(piece, index))]
    return released + shown.flush(), shown.cut


def test_the_completion_style_stop_drops_its_three_tokens() -> None:
    # "Liver" then "\nQuestion:" over three tokens: the reply is "Liver", and only its two tokens are shown
    released, cut = shown_steps([" Liv", "er", "\n", "Question", ":"], ["\nQuestion:"])
    assert [out.text for out in released] == [" Liv", "er"]
    assert [out.report.step for out in released] == [0, 1] and [out.logprobs.token for out in released] == [" Liv", "er"]
    assert cut == 3


def test_a_token_that_straddles_the_cut_shows_its_part_before_it() -> None:
    released, cut = shown_steps(["The end", "ing.STO", "P now"], ["STOP"])
    assert [out.text for out in released] == ["The end", "ing."] and cut == 1


def test_held_text_that_never_becomes_a_stop_is_shown_on_its_own_steps() -> None:
    released, cut = shown_steps(["a ", "\n", "Quest", " b"], ["\nQuestion:"])
    assert [out.text for out in released] == ["a ", "\n", "Quest", " b"] and cut == 0


@given(st.lists(st.text("ab\nQ:", max_size=4), max_size=12), st.lists(st.text("ab\nQ:", min_size=1, max_size=3),
                                                                       min_size=1, max_size=2))
def test_the_steps_shown_are_the_tokens_of_the_text_before_the_first_stop(pieces: list[str],
                                                                           stops: list[str]) -> None:
    joined = "".join(pieces)
    found = [at for at in (joined.find(stop) for stop in stops) if at >= 0]
    cut_at = min(found) if found else len(joined)
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    kept = [i for i, start in enumerate(starts) if start < cut_at or (start == cut_at and not pieces[i])]
    released, cut = shown_steps(pieces, stops)
    assert "".join(out.text for out in released) == joined[:cut_at]
    assert [out.report.step for out in released] == kept
    assert [out.text for out in released] == [pieces[i][: max(0, cut_at - starts[i])] for i in kept]
    assert cut == len(pieces) - len(kept)
