"""A small support-desk prompt program, written as @prompt functions.

    promptlang check examples/compile_demo.py
    promptlang compile examples/compile_demo.py                      # the schemas
    promptlang compile examples/compile_demo.py --call \
        'support(product="router", plan="pro", customer="Ada", question="Why is it blinking?")'
    python examples/compile_demo.py                                  # render one call

Everything before the customer's question is laid out statically and cached per
module: the system text, one module per product (a `match`), the plan's terms (an
`if/elif/else` union) and the greeting (a nested @prompt call whose `name` is a
bounded parameter). The question has no length bound, so it comes last and is sent
uncached with each request.
"""

from promptlang import prompt, system, user


@prompt(params={"name": 6})
def greeting(name: str, formal: bool):
    """How the reply addresses the customer."""
    if formal:
        f"Address the customer as {name}, formally.\n"
    else:
        f"Call the customer {name}.\n"


@prompt(name="demo.support")
def support(product: str, plan: str, customer: str, question: str, formal: bool = False):
    """A support-desk prompt: product manual, plan terms, greeting, then the question."""
    with system():
        """
        You are the support assistant of Example Networks.
        Answer in at most three sentences and never invent part numbers.
        """
        match product:
            case "router":
                ("Router manual: a blinking orange light means no uplink; hold RESET "
                 "for ten seconds to restore factory settings.\n")
            case "camera" | "doorbell":
                ("Camera and doorbell manual: both record to the cloud; the status light "
                 "is blue when recording.\n")
            case _:
                "This product has no manual here; offer to open a ticket.\n"
        if plan == "pro":
            "The customer has a Pro plan: next-day replacement is included.\n"
        elif plan == "basic":
            "The customer has a Basic plan: repairs take up to two weeks.\n"
        else:
            "The customer has no plan: quote the repair price before anything else.\n"
        greeting(customer, formal)
    with user():
        question


if __name__ == "__main__":
    from promptlang.tokenizer import WordTokenizer

    request = support("router", "pro", "Ada", "Why is the light blinking?")
    print(request.prompt_pml())
    print(request.render(WordTokenizer()))
