"""A GGUF model's chat template, rendered the way llama.cpp renders it.

Which template, in order:

1. an explicit one: a Jinja file, or the name of one of llama.cpp's built-in
   templates (``gemma``, ``chatml``, ``llama3``, ... : ``llama_chat_builtin_templates``);
2. the GGUF's own ``tokenizer.chat_template`` (Jinja, as the model's tokenizer
   config carries it), rendered by llama-cpp-python's ``Jinja2ChatFormatter``
   (the sandboxed environment and helpers of transformers' ``apply_chat_template``);
3. none: a GGUF without a template is a base model (the embedded Gemma-3 270M is
   one), and a chat template it was never trained on makes it repeat the question;
   it gets :class:`edge_sdk.prompts.QuestionAnswerPrompt` (``Question: ...\nAnswer:``,
   the reply ending at the next question).  An instruction-tuned GGUF whose
   template was stripped takes its built-in one by name (``--chat-template gemma``;
   a test checks llama.cpp's ``gemma`` gives the ids of Gemma 3's published Jinja
   template under transformers).

Tokenising follows each kind's convention.  A Jinja template writes BOS itself
(``{{ bos_token }}``) and its output is tokenised without adding one, as
transformers does; a built-in template writes none and the tokenizer adds BOS
when the GGUF says so (``tokenizer.ggml.add_bos_token``), as llama.cpp's server
does.  Control-token strings in the rendered text (``<start_of_turn>``) are read
as those tokens.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.prompts import QuestionAnswerPrompt


def builtin_templates() -> list[str]:
    """The names of llama.cpp's built-in chat templates."""
    import llama_cpp

    names = (ctypes.c_char_p * 256)()
    count = llama_cpp.llama_chat_builtin_templates(names, len(names))
    return sorted(names[i].decode() for i in range(min(count, len(names))))


def render_builtin(name: str, messages: Sequence[Mapping[str, str]]) -> str:
    """``messages`` rendered by llama.cpp's built-in template ``name``, ending with the reply's opening."""
    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))()
    keep = []  # the C structs hold pointers into these bytes
    for i, message in enumerate(messages):
        role, content = message["role"].encode(), message["content"].encode("utf-8")
        keep += [role, content]
        chat[i].role, chat[i].content = role, content
    size = 2 * sum(len(b) for b in keep) + 256
    while True:
        buffer = ctypes.create_string_buffer(size)
        written = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages), True, buffer, size)
        if written < 0:
            raise ValueError(f"llama.cpp has no chat template named {name!r}")
        if written <= size:
            return buffer.raw[:written].decode("utf-8")
        size = written


@dataclass
class LlamaCppChatTemplate:
    """The chat template of a :class:`LlamaCppSLM`'s model (see the module docstring for which one).

    ``source`` says where it came from (for ``--help``, logs and ``/coveil/info``).
    """

    slm: LlamaCppSLM
    source: str
    jinja: str | None = None
    builtin: str | None = None
    _formatter: Any = field(default=None, repr=False)

    #: a chat template ends the reply with its end-of-turn token, not with text
    stops: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def for_model(
        cls, slm: LlamaCppSLM, override: str | Path | None = None
    ) -> LlamaCppChatTemplate | QuestionAnswerPrompt:
        """Resolve the template: ``override`` (a Jinja file or a built-in name), the GGUF's own, or (none) the
        completion-style prompt of a base model."""
        builtins = builtin_templates()
        if override is not None:
            text = str(override)
            if text in builtins:
                return cls(slm, f"llama.cpp built-in {text!r}", builtin=text)
            path = Path(text).expanduser()
            if not path.is_file():
                raise ValueError(f"chat template {text!r} is neither a file nor one of llama.cpp's built-in "
                                 f"templates ({', '.join(builtins)})")
            return cls(slm, f"file {path}", jinja=path.read_text())
        own = slm.metadata.get("tokenizer.chat_template")
        if own:
            return cls(slm, "the GGUF's tokenizer.chat_template", jinja=own)
        return QuestionAnswerPrompt(slm)

    def text(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The rendered prompt text, ending with the opening of the assistant's reply."""
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.builtin is not None:
            return render_builtin(self.builtin, plain)
        if self._formatter is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            bos = self.slm.token_text(self.slm.bos_token_id) if self.slm.bos_token_id >= 0 else ""
            eos_id = min(self.slm.eos_token_ids)
            self._formatter = Jinja2ChatFormatter(self.jinja or "", eos_token=self.slm.token_text(eos_id),
                                                  bos_token=bos, add_generation_prompt=True)
        try:
            return self._formatter(messages=plain).prompt
        except Exception as exc:  # noqa: BLE001 - raise_exception, a jinja2.TemplateError: one line naming it
            raise ValueError(f"the chat template ({self.source}) failed on this conversation: {exc}") from None

    def render(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The prompt's token ids (BOS as the template's kind adds it; control-token strings read as tokens)."""
        add_bos = self.builtin is not None and self.slm.add_bos_token
        return self.slm.tokenize(self.text(messages), add_bos=add_bos, special=True)
