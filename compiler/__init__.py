"""The compiler: @prompt Python functions -> PML schemas and prompts.

    analyze.py     source -> IR (libcst, positions)     syntax.py      facts read off libcst nodes
    ir.py          the IR: one frozen record per item   resolve.py     names and length bounds
    lower.py       IR -> PML module + FunctionPlan      names.py       PML names from source
    plan.py        FunctionPlan: a PlannedItem per item instrument.py  the traced twin
    trace.py       one call -> its PML prompt           decorator.py   @prompt, PromptFunction
    generation.py  gen(), select()                      prompt.py      CompiledPrompt
    markers.py     MaxTokens, system/user/assistant     diagnostics.py codes, CompileError
    source.py      reading a function's source          cli.py         compile / check
    jinja/         Jinja2 templates -> PML (from_template)  cache_plan.py  compile --plan

Depends on the PML layer only (promptlang.pml, .errors, .inputs, .tokenizer): no runtime,
no torch. Running a program with a model (`fn.run`) is the public face's
(promptlang/programs.py); the compiler's side of it is trace.Program / trace.Live.
"""

from promptlang.compiler.decorator import PromptFunction, prompt
from promptlang.compiler.diagnostics import CODES, Diagnostic
from promptlang.compiler.generate_calls import gen, select
from promptlang.compiler.markers import MaxTokens, assistant, system, user
from promptlang.errors import CompileError
from promptlang.pml.prompt import Prompt

__all__ = ["prompt", "Prompt", "PromptFunction", "MaxTokens", "system", "user", "assistant",
           "gen", "select", "CompileError", "Diagnostic", "CODES"]
