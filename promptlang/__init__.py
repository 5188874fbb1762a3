"""promptlang: prompt programs as Python functions, served from modular KV caches.

    from promptlang import prompt, load
    llm = load()                       # the embedded default model (SmolLM2-135M-Instruct)
    print(llm.generate(my_prompt(...)).text)

Importing this package does not import torch; `load` does, on first use.
"""

from promptlang.errors import (ArgumentTooLongError, PMLSyntaxError, PromptLangError,
                               UnionConflictError, UnknownModuleError, UnknownParameterError)

__version__ = "0.1.0"

__all__ = ["prompt", "Prompt", "MaxTokens", "system", "user", "assistant", "gen", "select",
           "load", "parse", "from_template", "template_environment",
           "PromptLangError", "PMLSyntaxError", "UnknownModuleError", "UnknownParameterError",
           "ArgumentTooLongError", "UnionConflictError", "__version__"]

_LAZY = {
    "prompt": "promptlang.compiler", "Prompt": "promptlang.pml.prompt",
    "MaxTokens": "promptlang.compiler", "system": "promptlang.compiler",
    "user": "promptlang.compiler", "assistant": "promptlang.compiler",
    "gen": "promptlang.compiler", "select": "promptlang.compiler",
    "load": "promptlang.runtime", "parse": "promptlang.pml.parser",
    "from_template": "promptlang.compiler.jinja",
    "template_environment": "promptlang.compiler.jinja",
}


def __getattr__(name: str):
    """Import the compiler and the runtime (torch) only when their names are used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'promptlang' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(module), name)
