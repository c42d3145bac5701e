"""Chat templates: llama.cpp's rendering on the edge against Gemma 3's published template under transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_sdk.backends.chat_template import LlamaCppChatTemplate
from edge_sdk.prompts import QuestionAnswerPrompt, chat_prompts

pytestmark = pytest.mark.model

#: Gemma 3's chat template as google/gemma-3-*-it publish it (tokenizer_config.json "chat_template")
GEMMA3_TEMPLATE = Path(__file__).parents[1] / "data" / "gemma3_chat_template.jinja"

CONVERSATIONS = [
    [{"role": "user", "content": "Which organ is affected?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "  Which organ?  "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name a fruit.\nJust one."}],
]


def test_llama_cpps_gemma_template_matches_the_published_one(slm, gemma_llm) -> None:
    """llama.cpp's built-in 'gemma' (``--chat-template gemma``) gives the ids that transformers'
    apply_chat_template gives with Gemma 3's published Jinja template, for every conversation."""
    builtin = LlamaCppChatTemplate.for_model(slm, "gemma")
    jinja = LlamaCppChatTemplate.for_model(slm, GEMMA3_TEMPLATE)  # the Jinja path: llama-cpp-python's formatter
    published = GEMMA3_TEMPLATE.read_text()
    for conversation in CONVERSATIONS:
        reference = gemma_llm.tokenizer.apply_chat_template(conversation, chat_template=published,
                                                             add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)
        assert builtin.render(conversation) == jinja.render(conversation) == list(reference)


def test_the_embedded_base_model_gets_the_question_and_answer_prompt(slm) -> None:
    """The embedded GGUF carries no chat template (a base model): Gemma's turn format made it repeat the
    question; it gets ``Question: ...\nAnswer:``."""
    assert "tokenizer.chat_template" not in slm.metadata
    prompt = LlamaCppChatTemplate.for_model(slm)
    assert isinstance(prompt, QuestionAnswerPrompt) and prompt.stops == ("\nQuestion:",)
    expected = slm.tokenize("Question: Which organ?\nAnswer:", add_bos=True)
    assert prompt.render([{"role": "user", "content": "Which organ?"}]) == expected


def test_the_private_context_opens_the_last_user_turn_of_the_slms_prompt_only(slm) -> None:
    template = LlamaCppChatTemplate.for_model(slm, "gemma")
    conversation = CONVERSATIONS[2]
    prompts = chat_prompts(template, conversation, "Private: I am allergic to apples.")
    # written out by hand in Gemma's turn format
    expected_slm = ("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
                    "<start_of_turn>user\nPrivate: I am allergic to apples.\n\nName a fruit.\nJust one.<end_of_turn>\n"
                    "<start_of_turn>model\n")
    expected_cloud = expected_slm.replace("Private: I am allergic to apples.\n\n", "")
    assert list(prompts.slm_ids) == slm.tokenize(expected_slm, add_bos=True, special=True)
    assert list(prompts.cloud_ids) == slm.tokenize(expected_cloud, add_bos=True, special=True)
    assert prompts.private_text == "Private: I am allergic to apples."
    assert slm.tokenize("<start_of_turn>", add_bos=False, special=True) == [105]  # one control token, not text


def test_template_errors_are_one_line_naming_the_template(slm, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a file nor one of llama.cpp's built-in templates"):
        LlamaCppChatTemplate.for_model(slm, "no-such-template")
    assert LlamaCppChatTemplate.for_model(slm, "chatml").builtin == "chatml"
    jinja = LlamaCppChatTemplate.for_model(slm, GEMMA3_TEMPLATE)
    with pytest.raises(ValueError, match="roles must alternate"):
        jinja.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="no user message"):
        chat_prompts(jinja, [{"role": "system", "content": "only a system prompt"}])
