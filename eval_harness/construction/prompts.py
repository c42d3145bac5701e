"""The judge's prompts: data files with a ``[system]`` and a ``[user]`` section and ``$placeholders``.

Built in (``prompts/``): ``screen_clinical.txt`` (patient-specific clinical clues), ``screen_narrative.txt``
(events, motives, feelings, timelines of a story) and the shared ``extract.txt``. A file of your own takes
the same form; the placeholders are

* ``$private_context``, ``$public_query`` (both required), ``$options`` (one ``(A) text`` line per option),
  ``$target_answer`` (``(B) text``), ``$domain`` (the build's ``--domain``);

and ``$$`` writes a literal dollar sign. The prompt's digest is part of every cached request's key, so
editing a prompt re-asks the judge.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from eval_harness.construction.sources import SplitItem

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
#: screening prompts by domain
SCREENING_PROMPTS = {"clinical": PROMPTS_DIR / "screen_clinical.txt",
                     "narrative": PROMPTS_DIR / "screen_narrative.txt"}
EXTRACTION_PROMPT = PROMPTS_DIR / "extract.txt"
PLACEHOLDERS = ("private_context", "public_query", "options", "target_answer", "domain")
REQUIRED_PLACEHOLDERS = ("private_context", "public_query")


def format_options(options: Mapping[str, str]) -> str:
    """``(A) first\\n(B) second``: one line per option, in the item's order."""
    return "\n".join(f"({letter}) {text.strip()}" for letter, text in options.items())


@dataclass(frozen=True)
class PromptTemplate:
    """A system and a user message template (``string.Template`` syntax)."""

    name: str
    system: str
    user: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(f"[system]\n{self.system}\n[user]\n{self.user}".encode()).hexdigest()

    def messages(self, item: SplitItem, domain: str, *, system_role: bool = True) -> list[dict[str, str]]:
        """The chat messages asking about ``item``: a system and a user message, or (``system_role=False``) one
        user message opening with the system text, as chat templates without a system role render it."""
        values = {"private_context": item.private_context, "public_query": item.public_query,
                  "options": format_options(item.options), "target_answer": f"({item.answer_idx}) {item.answer.strip()}",
                  "domain": domain}
        system = string.Template(self.system).substitute(values)
        user = string.Template(self.user).substitute(values)
        if not system_role:
            return [{"role": "user", "content": f"{system}\n\n{user}"}]
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def load_prompt(path: str | Path) -> PromptTemplate:
    """Read a prompt file (``ValueError`` naming the file if a section or a placeholder is wrong)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.strip() in ("[system]", "[user]"):
            name = line.strip()[1:-1]
            if name in sections:
                raise ValueError(f"prompt {path}: section [{name}] appears twice")
            current = sections.setdefault(name, [])
        elif current is not None:
            current.append(line)
        elif line.strip():
            raise ValueError(f"prompt {path}: text before the first [system] or [user] line")
    if set(sections) != {"system", "user"}:
        raise ValueError(f"prompt {path}: needs a [system] and a [user] section, found {sorted(sections) or 'none'}")
    prompt = PromptTemplate(path.name, "\n".join(sections["system"]).strip(), "\n".join(sections["user"]).strip())
    used: set[str] = set()
    for part in (prompt.system, prompt.user):
        for match in string.Template.pattern.finditer(part):
            if match.group("invalid") is not None:
                raise ValueError(f"prompt {path}: a lone '$' at offset {match.start('invalid')} (write $$ for a "
                                 "dollar sign)")
            name = match.group("named") or match.group("braced")
            if name is not None:
                if name not in PLACEHOLDERS:
                    raise ValueError(f"prompt {path}: unknown placeholder ${name} (known: "
                                     f"{', '.join('$' + p for p in PLACEHOLDERS)})")
                used.add(name)
    missing = [f"${name}" for name in REQUIRED_PLACEHOLDERS if name not in used]
    if missing:
        raise ValueError(f"prompt {path}: never shows the judge {' or '.join(missing)}")
    return prompt


def screening_prompt(name_or_path: str) -> PromptTemplate:
    """The built-in screening prompt of a domain (``clinical``, ``narrative``) or a prompt file."""
    if name_or_path in SCREENING_PROMPTS:
        return load_prompt(SCREENING_PROMPTS[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--screen-prompt {name_or_path!r} is neither a built-in domain "
                         f"({', '.join(SCREENING_PROMPTS)}) nor a prompt file")
    return load_prompt(path)
