"""Structured output resumes across roles (issue 25): each engine feeds the answer so far
to the request's grammar before vLLM samples, once (services.engine.vllm.bridge)."""

from bus_schemas.requests import SamplingParams


def test_engines_feed_the_answer_so_far_to_the_grammar():
    from bus_schemas.requests import StructuredOutput
    from services.engine.vllm.bridge import Plan, advance_grammar
    from services.engine.vllm.engine import _answer_so_far

    s = SamplingParams(structured=StructuredOutput(regex="a+"))
    assert _answer_so_far(s, [1, 2, 3]) == []  # prefill of a fresh request
    assert _answer_so_far(s, [1, 2, 3], first=9) == [9]  # its decode
    resumed = SamplingParams(structured=StructuredOutput(regex="a+", answer_start=2))
    assert _answer_so_far(resumed, [1, 2, 5, 6]) == [5, 6]  # a migrated prefill
    assert _answer_so_far(resumed, [1, 2, 5, 6], first=7) == [5, 6, 7]
    assert _answer_so_far(SamplingParams(), [1, 2], first=3) == []

    class Grammar:
        def __init__(self, ok: bool) -> None:
            self.ok, self.fed = ok, []

        def accept_tokens(self, rid, tokens):
            self.fed.append(tokens)
            return self.ok

    class Req:
        def __init__(self, g) -> None:
            self.request_id = "r"
            self.structured_output_request = type("S", (), {"grammar": g})()

    g = Grammar(True)
    p = Plan(key="r", slots=[], grammar_prefix=[5, 6])
    advance_grammar(p, Req(g))
    advance_grammar(p, Req(g))  # scheduled again (preempted): fed once only
    assert g.fed == [[5, 6]] and p.error is None
    bad = Plan(key="r", slots=[], grammar_prefix=[5])
    advance_grammar(bad, Req(Grammar(False)))
    assert bad.error is not None
    none = Plan(key="r", slots=[], grammar_prefix=[5])
    advance_grammar(none, Req(None))
    assert none.error is not None
    untouched = Plan(key="r", slots=[])
    advance_grammar(untouched, Req(None))
    assert untouched.error is None
