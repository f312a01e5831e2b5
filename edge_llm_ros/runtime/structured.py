"""One place that turns a request's tools, constraints and reasoning into what the loop runs.

plan_request() is what Engine.prepare calls at admission (once per request, no model call): it
checks tools and tool_choice, refuses conflicting constraints, renders the prompt with the tools
through the model's template (or the text fallback) and the family's template switches, compiles
the one constraint, and returns the prompt ids with an OutputPlan.

OutputPlan.start() gives the generator, per generation, an OutputPipeline: fed each text delta
(after stop strings), it returns the user-visible text, the reasoning and the tool-call deltas
apart; forced_tokens() says, before each pick, whether the reasoning budget forces the close
tag; at the end it holds the parsed calls. Pure: no model, no rclpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.constraint import compile_request_constraint, GrammarConstraint
from edge_llm_ros.runtime.model_config import ModelFamilyConfig, ReasoningConfig
from edge_llm_ros.runtime.reasoning import (close_ids, prompt_opens_reasoning, ReasoningBudget,
                                            ReasoningSplitter)
from edge_llm_ros.runtime.tokenizer import MessageLike, TextTokenizer
from edge_llm_ros.runtime.tools.formats import FORMATS, tool_format, ToolFormat
from edge_llm_ros.runtime.tools.grammar import compile_tool_constraint, with_reasoning
from edge_llm_ros.runtime.tools.parser import InvalidToolCall, ToolCallDelta, ToolCallParser
from edge_llm_ros.runtime.tools.render import chat_inputs
from edge_llm_ros.runtime.tools.spec import (check_single_constraint, check_tools,
                                             parse_tool_choice, ToolCall, ToolChoice,
                                             tools_in_scope, ToolSpec)


@dataclass(frozen=True)
class OutputDelta:
    text: str = ''
    reasoning: str = ''
    tool_calls: Tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class OutputPlan:
    """How to read one request's output (immutable, kept on the PreparedRequest)."""

    tool_format: Optional[ToolFormat] = None   # None: no tools in scope, nothing parsed
    tools: Tuple[ToolSpec, ...] = ()
    reasoning: Optional[ReasoningConfig] = None
    starts_in_reasoning: bool = False
    reasoning_budget: Optional[int] = None     # None: unlimited
    close_ids: Tuple[int, ...] = ()

    def start(self) -> 'OutputPipeline':
        return OutputPipeline(self)


class OutputPipeline:
    """Splits one generation's text (see the module docstring)."""

    def __init__(self, plan: OutputPlan) -> None:
        self._splitter = (ReasoningSplitter(plan.reasoning, plan.starts_in_reasoning)
                          if plan.reasoning is not None else None)
        self._parser = (ToolCallParser(plan.tool_format, plan.tools)
                        if plan.tool_format is not None else None)
        self._budget = (ReasoningBudget(plan.reasoning_budget, plan.close_ids)
                        if self._splitter is not None and plan.reasoning_budget is not None
                        else None)
        self._text: List[str] = []
        self._reasoning: List[str] = []

    def forced_tokens(self) -> Tuple[int, ...]:
        """Call before each pick: ids to feed instead of sampling (the close tag), or ()."""
        if self._budget is None:
            return ()
        return self._budget.before_pick(self._splitter.in_reasoning)

    def feed(self, delta: str) -> OutputDelta:
        return self._route(self._splitter.feed(delta) if self._splitter else None, delta, False)

    def finish(self) -> OutputDelta:
        """End of output: release what was held back."""
        split = self._splitter.finish() if self._splitter else None
        return self._route(split, '', True)

    def _route(self, split: Any, delta: str, last: bool) -> OutputDelta:
        text, reasoning = (split.text, split.reasoning) if split is not None else (delta, '')
        calls: Tuple[ToolCallDelta, ...] = ()
        if self._parser is not None:
            parsed = self._parser.feed(text)
            text, calls = parsed.text, parsed.tool_calls
            if last:
                end = self._parser.finish()
                text, calls = text + end.text, calls + end.tool_calls
        self._text.append(text)
        self._reasoning.append(reasoning)
        return OutputDelta(text, reasoning, calls)

    @property
    def text(self) -> str:
        return ''.join(self._text)

    @property
    def reasoning(self) -> str:
        return ''.join(self._reasoning)

    @property
    def tool_calls(self) -> List[ToolCall]:
        return list(self._parser.calls) if self._parser else []

    @property
    def invalid_tool_calls(self) -> List[InvalidToolCall]:
        return list(self._parser.invalid) if self._parser else []


@dataclass(frozen=True)
class RequestPlan:
    prompt_ids: Tuple[int, ...]
    prompt_text: str
    constraint: Optional[GrammarConstraint]
    output: OutputPlan
    tool_choice: ToolChoice
    # render(messages) -> the prompt text of other messages with this request's tools and
    # template options (a session goal renders its stored turns with them at bind time).
    render: Optional[Callable[[Sequence[MessageLike]], str]] = None


def plan_request(tokenizer: TextTokenizer, family: Optional[ModelFamilyConfig],
                 messages: Sequence[MessageLike], *, tools: Sequence[Any] = (),
                 tool_choice: Any = '', parallel_tool_calls: bool = True,
                 json_schema: str = '', grammar: str = '', regex: str = '',
                 choices: Sequence[str] = (), reasoning: bool = True,
                 reasoning_budget: Optional[int] = None,
                 compile_schema: Optional[Callable[[str], GrammarConstraint]] = None
                 ) -> RequestPlan:
    """Check and build everything above for one chat request (InvalidRequestError subclasses).

    family None (a model no config matches) means no reasoning tags and generic JSON tool
    calls. compile_schema lets the engine cache JSON-schema compiles across requests.
    """
    specs = check_tools(tools)
    choice = parse_tool_choice(tool_choice, specs)
    scope = tools_in_scope(specs, choice)
    fmt = _format(family) if scope else None
    kwargs = _template_kwargs(family, reasoning)
    in_scope, call_format = (specs if scope else ()), fmt or _format(family)

    def render(turns: Sequence[MessageLike]) -> str:
        dicts, template_tools = chat_inputs(tokenizer, turns, in_scope, call_format)
        return tokenizer.apply_chat_template(dicts, True, template_tools, kwargs)
    prompt = render(messages)
    ids = tokenizer.encode_prompt(prompt)
    rcfg = family.reasoning if family is not None else None
    opens = rcfg is not None and (rcfg.starts_open or prompt_opens_reasoning(prompt, rcfg))
    if reasoning_budget is not None and rcfg is None:
        raise InvalidRequestError('reasoning_budget is set but this model has no reasoning '
                                  'tags (see its config/models file); leave it unset')
    kind = check_single_constraint(tools=bool(scope), json_schema=json_schema,
                                   grammar=grammar, regex=regex, choices=choices)
    if kind == 'tools':
        constraint = compile_tool_constraint(specs, choice, fmt, tokenizer, rcfg, opens,
                                             parallel_tool_calls)
    elif kind == 'json_schema' and compile_schema is not None:
        constraint = compile_schema(json_schema)
    else:
        constraint = compile_request_constraint(tokenizer, json_schema, grammar, regex, choices)
    if kind not in (None, 'tools') and rcfg is not None and reasoning:
        # A constraint on a reasoning model leaves the reasoning block free.
        constraint = with_reasoning(constraint, tokenizer, rcfg, opens)
    output = OutputPlan(tool_format=fmt, tools=scope, reasoning=rcfg,
                        starts_in_reasoning=opens, reasoning_budget=reasoning_budget,
                        close_ids=close_ids(tokenizer, rcfg) if rcfg is not None else ())
    if reasoning_budget is not None:
        ReasoningBudget(reasoning_budget, output.close_ids)  # checks the value now
    return RequestPlan(tuple(ids), prompt, constraint, output, choice, render)


def _format(family: Optional[ModelFamilyConfig]) -> ToolFormat:
    name = family.tool_call_format if family is not None else 'generic_json'
    return tool_format(name if name in FORMATS else 'generic_json')


def _template_kwargs(family: Optional[ModelFamilyConfig], reasoning: bool) -> dict:
    return family.template_kwargs(reasoning) if family is not None else {}
