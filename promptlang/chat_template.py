"""Chat-role text cut out of a tokenizer's own jinja2 chat template.

Conversations whose contents are sentinel strings are rendered through the template and
the text around each sentinel is cut out: `<user>` becomes the template's user prefix,
`</user>` its suffix, and so on for every role. A template with no such per-role split
gets a plain format instead (`PLAIN_AFFIXES`). No model's tokens are ever hard-coded.
"""

from __future__ import annotations

from typing import Callable, Mapping


PLAIN_AFFIXES: Mapping[str, tuple[str, str]] = {
    "system": ("System: ", "\n\n"),
    "user": ("User: ", "\n\n"),
    "assistant": ("Assistant: ", "\n\n"),
}

# Contents no template rewrites (no spaces to trim, no markup) and none contains another.
_S1 = "zqsysonezq"
_U1 = "zquseronezq"
_A1 = "zqasstonezq"
_U2 = "zqusertwozq"
_A2 = "zqassttwozq"
_U3 = "zquserthreezq"


Render = Callable[[list[dict[str, str]], bool], str]


class _Unsplittable(Exception):
    """The template's output cannot be cut into per-role prefix and suffix text."""


def derive_role_affixes(render: Render,
                        bos_text: str = "") -> tuple[dict[str, tuple[str, str]], str]:
    """Cut (prefix, suffix) text per role out of renders of sentinel conversations.

    - suffix(user), suffix(assistant): what follows the role's content when its
      message is the last one;
    - prefix(assistant): the generation prompt (add_generation_prompt=True minus
      False), which must also be what precedes an assistant message in a history
      (a template that ignores add_generation_prompt yields "": the history's
      text is used, and a generation prompt adds nothing);
    - prefix(user): what lies between an assistant message and the next user
      message, minus suffix(assistant);
    - prefix(system): what precedes the system content in [system, user, ...],
      without the BOS text that the tokenizer's prefix ids supply; suffix(system):
      what lies between system and user content, minus prefix(user).

    Whole conversations are then rendered again and compared with the
    concatenation of affixes and contents. A template that rejects a system
    message, drops it or merges it into the user turn (Llama-2's <<SYS>>) gets
    the user affixes for system; one that fails for user/assistant gets
    `PLAIN_AFFIXES`. Returns (affixes, a description of their source).
    """
    def message(role: str, content: str) -> dict[str, str]:
        return {"role": role, "content": content}

    def attempt(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        try:
            return render(messages, add_generation_prompt)
        except Exception as err:     # a template is arbitrary code: any failure means "cannot"
            raise _Unsplittable(f"the template fails on {[m['role'] for m in messages]}: "
                                f"{type(err).__name__}: {err}") from None

    try:
        turns = attempt([message("user", _U1), message("assistant", _A1), message("user", _U2)])
        user_suffix = _after(turns, _U2)
        assistant_suffix = _after(attempt([message("user", _U1), message("assistant", _A1)]),
                                  _A1)
        user_prefix = _drop_head(_between(turns, _A1, _U2), assistant_suffix)
        history_prefix = _drop_head(_between(turns, _U1, _A1), user_suffix)
        alone = [message("user", _U1)]
        generation = _drop_head(attempt(alone, True), attempt(alone))
        if generation and generation != history_prefix:
            raise _Unsplittable(f"the generation prompt {generation!r} differs from the text "
                                f"before an assistant message {history_prefix!r}")
        affixes = {"user": (user_prefix, user_suffix),
                   "assistant": (history_prefix, assistant_suffix)}
        if not user_prefix and not user_suffix:
            raise _Unsplittable("the template puts no text around user messages")
        conversation = [message("user", _U1), message("assistant", _A1), message("user", _U2),
                        message("assistant", _A2), message("user", _U3)]
        _verify(attempt, conversation, affixes, preamble=None)
        _verify(attempt, conversation, affixes, preamble=None, generation=generation)
    except _Unsplittable as why:
        return dict(PLAIN_AFFIXES), f"plain format ({why})"

    try:
        with_system = [message("system", _S1), message("user", _U1), message("assistant", _A1),
                       message("user", _U2)]
        rendered = attempt(with_system)
        system_prefix = _before(rendered, _S1)
        if bos_text and system_prefix.startswith(bos_text):
            system_prefix = system_prefix[len(bos_text):]     # the prefix ids supply it
        system_suffix = _drop_tail(_between(rendered, _S1, _U1), user_prefix)
        affixes["system"] = (system_prefix, system_suffix)
        _verify(attempt, with_system, affixes, preamble=bos_text)
        _verify(attempt, with_system + [message("assistant", _A2)], affixes, preamble=bos_text)
        _verify(attempt, with_system, affixes, preamble=bos_text, generation=generation)
    except _Unsplittable as why:
        affixes["system"] = affixes["user"]
        return affixes, f"chat template (system rendered as user: {why})"
    return affixes, "chat template"


def _verify(attempt: Callable[..., str], messages: list[dict[str, str]],
            affixes: Mapping[str, tuple[str, str]], *, preamble: str | None,
            generation: str | None = None) -> None:
    """The render must be (preamble +) the concatenation of affixes and contents
    (+ the generation prompt, when `generation` is not None). preamble None: any
    text may precede the first message (a template's default system message, a
    BOS); otherwise only "" or `preamble`."""
    rendered = attempt(messages, generation is not None)
    body = "".join(affixes[m["role"]][0] + m["content"] + affixes[m["role"]][1]
                   for m in messages) + (generation or "")
    lead = rendered[:len(rendered) - len(body)]
    if not rendered.endswith(body) or (preamble is not None and lead not in ("", preamble)):
        roles = [m["role"] for m in messages]
        raise _Unsplittable(f"rendering {roles} is not the concatenation of the derived affixes")


def _position(text: str, marker: str) -> int:
    if text.count(marker) != 1:
        raise _Unsplittable(f"the template renders a message {text.count(marker)} times")
    return text.index(marker)


def _before(text: str, marker: str) -> str:
    return text[:_position(text, marker)]


def _after(text: str, marker: str) -> str:
    return text[_position(text, marker) + len(marker):]


def _between(text: str, first: str, second: str) -> str:
    start = _position(text, first) + len(first)
    end = _position(text, second)
    if end < start:
        raise _Unsplittable("the template reorders messages")
    return text[start:end]


def _drop_head(text: str, head: str) -> str:
    if not text.startswith(head):
        raise _Unsplittable(f"{text!r} does not start with {head!r}")
    return text[len(head):]


def _drop_tail(text: str, tail: str) -> str:
    if not text.endswith(tail):
        raise _Unsplittable(f"{text!r} does not end with {tail!r}")
    return text[:len(text) - len(tail)]
