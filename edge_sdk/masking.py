"""``never_upload``: spans of the private context whose tokens the SLM says nothing about to the cloud.

The session removes the SLM's values for these ids before any policy runs
(``edge_sdk.session``), so no upload, token or refusal is shaped by the span;
a masked token can still be chosen on the cloud's own probability, exactly
as a word the context never mentions (refusing it would tell a probing cloud
which words are hidden).

The mask is deliberately wider than DecodeLeak's content tokens: a span the
user marks is masked whatever its words are (stop words, short words such as
"Dr. Li", non-ASCII names such as "王小明"), in every spelling a model can
produce mid-text: as given, lower case, upper case, capitalised and title
case, each with and without a leading space, and each of its words alone in
the same forms.  Only tokens that spell nothing but punctuation or
whitespace are left out (masking "." would say nothing about the span and
break every sentence).  A span none of whose tokens can be masked is an
error, never a silent no-op.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterable

#: a full-vocabulary upload keeps only its this-many largest values while a mask is active: with every id
#: listed, the missing masked ids would stand out; among the ids left out of a top-1000 they do not
MASKED_UPLOAD_LIMIT = 1000


def spellings(span: str) -> list[str]:
    """The forms of ``span`` a model may generate: case variants of the span and of each word, with and
    without a leading space."""
    span = " ".join(span.split())
    forms: list[str] = []
    for text in (span, *span.split(" ")):
        for variant in (text, text.lower(), text.upper(), text.capitalize(), text.title()):
            for spaced in (variant, " " + variant):
                if variant and spaced not in forms:
                    forms.append(spaced)
    return forms


def _is_punctuation_or_space(text: str) -> bool:
    """Whether a token spells only punctuation or whitespace (a byte fragment of a character, shown as
    U+FFFD, is part of a word and counts as content)."""
    return "\ufffd" not in text and all(ch.isspace() or unicodedata.category(ch).startswith("P") for ch in text)


def never_upload_ids(
    spans: Iterable[str],
    private_context: str,
    tokenize: Callable[[str], list[int]],
    piece: Callable[[int], str],
) -> frozenset[int]:
    """Every token id that spells part of one of ``spans`` (see the module docstring).

    Raises ``ValueError`` for a span that does not occur in ``private_context``
    or that has no maskable token (only punctuation or whitespace).
    """
    masked: set[int] = set()
    for span in spans:
        if not span.strip():
            raise ValueError("a never_upload span must not be empty")
        if span not in private_context:
            raise ValueError(f"never_upload span {span!r} does not occur in the private context")
        ids = {i for form in spellings(span) for i in tokenize(form) if not _is_punctuation_or_space(piece(i))}
        if not ids:
            raise ValueError(f"never_upload span {span!r} has no token that could be masked (only punctuation)")
        masked |= ids
    return frozenset(masked)
