"""The compiler: @prompt Python functions -> PML schemas and prompts.

    analyze.py     source -> IR (libcst, positions)      ir.py        the IR
    lower.py       IR -> what is cached, PML nodes         instrument.py  the traced twin
    trace.py       one call -> its PML prompt              diagnostics.py  codes, CompileError
    decorator.py   @prompt, PromptFunction                 prompt.py     Prompt
    markers.py     MaxTokens, system/user/assistant        cli.py        compile / check
    generation.py  gen(), select()                         program.py    running a program

No torch here: `promptlang compile` works without it.
"""

from promptlang.compiler.decorator import PromptFunction, prompt
from promptlang.compiler.diagnostics import CODES, CompileError, Diagnostic
from promptlang.compiler.generation import gen, select
from promptlang.compiler.markers import MaxTokens, assistant, system, user
from promptlang.pml.prompt import Prompt

__all__ = ["prompt", "Prompt", "PromptFunction", "MaxTokens", "system", "user", "assistant",
           "gen", "select", "CompileError", "Diagnostic", "CODES"]
