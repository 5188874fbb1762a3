"""The Jinja2 frontend: prompt templates -> PML schemas and prompts, statically.

    expressions.py  which expressions may be cached; their values, by Jinja2
    plan.py         TemplatePlan: the schema, the call's steps, the uncached tail
    lower.py        the template's AST (Environment.parse) -> TemplatePlan, diagnostics
    template.py     from_template, TemplatePrompt (call it for a Prompt), template_environment

Like the rest of the compiler it knows the PML layer only: no runtime, no torch.
"""

from promptlang.compiler.jinja.template import (TemplatePrompt, from_template, maxlen,
                                                template_environment)

__all__ = ["from_template", "TemplatePrompt", "template_environment", "maxlen"]
