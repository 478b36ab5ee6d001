"""The models and tokenizers built in code (polyrl.models.tiny) for tests, benchmarks and the quickstart."""

from __future__ import annotations

import pytest


def test_char_tokenizer_padded_to_a_real_vocabulary_size_still_encodes_by_character(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from polyrl.models.tiny import build_char_tokenizer, make_tiny_model

    plain, padded = build_char_tokenizer(), build_char_tokenizer(vocab_size=1000)
    assert len(plain) == 262 and len(padded) == 1000
    text = "12+7=19, héllo <|x3|>"
    assert padded(text)["input_ids"] == plain(text)["input_ids"]  # the padding is never an encoding
    assert padded.decode(padded(text)["input_ids"]) == text
    assert padded.decode([999, plain.eos_token_id]) == "<|x737|><|end|>"  # a padding id decodes to its spelling
    path = make_tiny_model(tmp_path / "m", tokenizer=padded)
    assert AutoConfig.from_pretrained(path).vocab_size == 1000
    loaded = AutoTokenizer.from_pretrained(path)  # may be the model family's class (Qwen2's adds <|endoftext|>)
    assert loaded(text)["input_ids"] == padded(text)["input_ids"] and loaded.decode([999]) == "<|x737|>"
    with pytest.raises(ValueError, match="vocab_size=100 is below the 262 ids"):
        build_char_tokenizer(vocab_size=100)
