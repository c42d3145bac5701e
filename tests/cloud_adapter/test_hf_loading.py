"""Converting a GGUF for transformers once, when two processes (two test workers, two adapters on one machine)
convert the same file at the same time."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_adapter import hf_loading
from edge_sdk.models import ModelSource
from tests.support.tiny_models import bpe_tokenizer, random_qwen

pytestmark = pytest.mark.slow  # transformers and a tiny model


@pytest.fixture
def tiny_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_pretrained`` of the GGUF gives a tiny random model and its tokenizer (no GGUF is read)."""
    import transformers

    tokenizer = bpe_tokenizer()
    model = random_qwen(tokenizer, output_rows=448, seed=1)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)


def test_a_conversion_another_process_finished_first_is_used_and_nothing_is_left_behind(
        tmp_path: Path, tiny_transformers: None) -> None:
    target = tmp_path / "cache" / "model-0123"
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"written by": "the other process"}')
    hf_loading._convert_gguf(ModelSource(name="tiny", gguf_path=tmp_path / "tiny.gguf"), target)
    assert (target / "config.json").read_text() == '{"written by": "the other process"}'
    assert sorted(p.name for p in target.parent.iterdir()) == ["model-0123"]  # the staging copy is gone


def test_a_target_in_the_way_that_is_no_conversion_is_an_error(tmp_path: Path, tiny_transformers: None) -> None:
    target = tmp_path / "cache" / "model-0123"
    target.mkdir(parents=True)
    (target / "something else").write_text("")
    with pytest.raises(OSError):
        hf_loading._convert_gguf(ModelSource(name="tiny", gguf_path=tmp_path / "tiny.gguf"), target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model-0123"]


def test_a_first_conversion_lands_at_the_target(tmp_path: Path, tiny_transformers: None) -> None:
    target = tmp_path / "cache" / "model-0123"
    hf_loading._convert_gguf(ModelSource(name="tiny", gguf_path=tmp_path / "tiny.gguf"), target)
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["model-0123"]
