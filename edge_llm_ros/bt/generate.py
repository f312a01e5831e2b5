"""Generate: a py_trees behaviour that runs one llm_node goal without blocking the tree.

    llm = LLMClient(node, '/llm_node')      # node spun by an executor on another thread
    ask = Generate('choose skill', llm, keys=BlackboardKeys(prompt='/task'), tools=TOOLS,
                   tool_choice='required')
    tree = py_trees.trees.BehaviourTree(py_trees.composites.Sequence('do', True, [ask, ...]))
    tree.tick_tock(period_ms=50)

- First tick (initialise): sends the goal (prompt from `prompt` or the blackboard key
  keys.prompt, messages from keys.messages) and returns RUNNING.
- Later ticks: RUNNING while it streams (keys.partial, if set, holds the text so far),
  then SUCCESS when the goal succeeded, with the answer in keys.text and the tool calls in
  keys.tool_calls (a list of {'id', 'name', 'arguments': dict}), or FAILURE (rejected,
  aborted, invalid: feedback_message says why, and keys.error holds it).
- Halted by the tree (a higher-priority branch, or the tree stopped: terminate(INVALID))
  while the goal runs: the goal is cancelled and ends CANCELED on the node.

Ticks never wait for the model: they read the handle's state. The LLMClient's node must be
spinning in an executor (as py_trees_ros trees run beside their node's executor); only the
cancel in terminate() waits, for the cancel response (cancel_timeout_s at most).
"""
from __future__ import annotations

from dataclasses import dataclass
import json
from typing import Any, Dict, List, Optional, Tuple

import py_trees
from py_trees.common import Access, Status

from edge_llm_ros.client import GenerationHandle, LLMClient, LLMClientError


def tool_call_dicts(outcome: Any) -> List[Dict[str, Any]]:
    """Return an outcome's tool calls as plain dicts, arguments parsed from JSON."""
    calls = []
    for call in outcome.tool_calls:
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            arguments = {'_raw': call.arguments}   # kept visible, never silently dropped
        calls.append({'id': call.id, 'name': call.name, 'arguments': arguments})
    return calls


@dataclass(frozen=True)
class BlackboardKeys:
    """Where Generate reads its input and writes its output ('' = not used)."""

    prompt: str = ''                    # read: the prompt (else Generate's `prompt`)
    messages: str = ''                  # read: chat turns, ChatMessage or (role, content)
    text: str = '/llm/text'             # written on SUCCESS: the answer
    tool_calls: str = '/llm/tool_calls'     # written on SUCCESS: [{'id', 'name', 'arguments'}]
    error: str = '/llm/error'           # written on FAILURE: why
    partial: str = ''                   # written every tick: the text streamed so far

    def read(self) -> Tuple[str, ...]:
        return tuple(key for key in (self.prompt, self.messages) if key)

    def written(self) -> Tuple[str, ...]:
        return tuple(key for key in (self.text, self.tool_calls, self.error, self.partial)
                     if key)


class Generate(py_trees.behaviour.Behaviour):
    """One generation per run of the behaviour (see the module docstring)."""

    def __init__(self, name: str, client: LLMClient, *, prompt: str = '',
                 keys: BlackboardKeys = BlackboardKeys(), cancel_timeout_s: float = 2.0,
                 **goal_kwargs: Any) -> None:
        """Prepare the behaviour; goal_kwargs are LLMClient.generate's (make_goal's)."""
        super().__init__(name)
        if not prompt and not keys.prompt and not keys.messages:
            raise ValueError(f'{name}: give prompt, or keys.prompt or keys.messages')
        self.client = client
        self.prompt = prompt
        self.keys = keys
        self.cancel_timeout_s = cancel_timeout_s
        self.goal_kwargs = goal_kwargs
        self.handle: Optional[GenerationHandle] = None   # the current (or last) goal
        self.blackboard = self.attach_blackboard_client(name=name)
        for key in keys.read():
            self.blackboard.register_key(key, Access.READ)
        for key in keys.written():
            self.blackboard.register_key(key, Access.WRITE)

    def initialise(self) -> None:
        """Send the goal (called on the first tick of each run)."""
        keys = self.keys
        prompt = self.blackboard.get(keys.prompt) if keys.prompt else self.prompt
        messages = self.blackboard.get(keys.messages) if keys.messages else ()
        if keys.partial:
            self.blackboard.set(keys.partial, '')
        self.handle = self.client.generate(str(prompt or ''), messages=messages or (),
                                           **self.goal_kwargs)
        self.feedback_message = f'sent goal {self.handle.goal_id}'

    def update(self) -> Status:
        handle = self.handle
        if handle is None:
            return Status.FAILURE
        keys = self.keys
        if keys.partial:
            self.blackboard.set(keys.partial, handle.streamed_text)
        if not handle.done():
            return Status.RUNNING
        try:
            outcome = handle.result(timeout=0)
        except (LLMClientError, TimeoutError) as exc:
            return self._fail(str(exc))
        if not outcome.ok:
            return self._fail(outcome.error_message or
                              f'goal {outcome.status} ({outcome.finish_reason})')
        if keys.text:
            self.blackboard.set(keys.text, outcome.text)
        if keys.tool_calls:
            self.blackboard.set(keys.tool_calls, tool_call_dicts(outcome))
        if keys.partial:
            self.blackboard.set(keys.partial, outcome.text)
        self.feedback_message = f'{outcome.finish_reason}: {outcome.completion_tokens} tokens'
        return Status.SUCCESS

    def _fail(self, why: str) -> Status:
        self.feedback_message = why
        if self.keys.error:
            self.blackboard.set(self.keys.error, why)
        return Status.FAILURE

    def terminate(self, new_status: Status) -> None:
        """Cancel the goal when the tree halts this behaviour while it runs."""
        handle = self.handle
        if new_status == Status.INVALID and handle is not None and not handle.done():
            handle.cancel(timeout=self.cancel_timeout_s)
            self.feedback_message = f'halted: cancelled goal {handle.goal_id}'
