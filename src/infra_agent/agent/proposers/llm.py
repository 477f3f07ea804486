"""The ``llm`` proposer: an OpenAI-compatible chat model with tool calls.

The model sees a system prompt and an opening message (the workspace, the gate table
and the feedback on the current best, cut to ``prompt_token_budget``) and acts only
through the tools of :mod:`infra_agent.tools`.  ``propose`` runs the conversation
until the model calls ``run_experiment`` (the ``Step`` is returned, and the call's
result stays open) or ``finish`` (None).  ``observe`` answers the open call with the
experiment's verdict and feedback, so the next ``propose`` continues the same
conversation.

Caps on model calls (``max_turns``), tokens (``max_tokens``, from ``usage``) and the
time spent inside ``propose`` (``max_wall_s``) end the session: ``propose`` returns
None and ``stopped_reason`` says which cap.  ``messages``/``load_messages`` let the
loop keep the conversation in the ledger and resume it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.llm_client import ChatClient
from infra_agent.agent.proposers.llm_prompt import (
    SYSTEM_PROMPT,
    experiment_result,
    opening_message,
    plain,
)
from infra_agent.records import Experiment, Step
from infra_agent.tools import ToolContext, ToolRegistry, default_registry

log = logging.getLogger(__name__)

RUN_TOOL = "run_experiment"
FINISH_TOOL = "finish"
# Replies without a tool call in a row before the session is given up.
MAX_IDLE_REPLIES = 3
RESULT_CHARS = 8000
NUDGE = ("Use the tools: build a change (set_knobs, propose_diff) and call run_experiment with one hypothesis, "
         "or call finish with the reason.")


class LLMProposer:
    """See the module docstring.  ``propose``/``observe`` follow ``proposers.base.Proposer``."""

    name = "llm"

    def __init__(self, model: str, base_url: str, api_key: str | None = None, max_turns: int = 30,
                 max_tokens: int = 200_000, max_wall_s: float = 1800, prompt_token_budget: int = 12_000,
                 timeout_s: float = 60, max_retries: int = 4, *, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 temperature: float | None = None, protected: Sequence[str] = (),
                 registry: ToolRegistry | None = None) -> None:
        self.model = model
        self.base_url = base_url
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.max_wall_s = max_wall_s
        self.prompt_token_budget = prompt_token_budget
        self.client = ChatClient(model, base_url, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries,
                                 backoff_s=backoff_s, backoff_max_s=backoff_max_s, temperature=temperature)
        self.registry = registry or default_registry()
        self.ctx = ToolContext(code_root=Path.cwd(), protected=list(protected), submit_step=self._submit,
                               secrets=self.client.secrets)
        self._messages: list[dict[str, Any]] = []
        self._open_call: str | None = None  # the run_experiment call awaiting its verdict
        self._submitted: Step | None = None
        self.turns = 0  # model calls made
        self.tokens_used = 0
        self.wall_s = 0.0  # time spent inside propose()
        self.stopped_reason: str | None = None
        self.last_call_id: str | None = None  # the tool_call_id of the last run_experiment returned

    # ------------------------------------------------------------------ conversation state

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation so far, as plain JSON-able data (a copy)."""
        return plain(self._messages)

    def load_messages(self, messages: list[dict[str, Any]]) -> None:
        """Restore a conversation kept by ``messages`` (resume).

        A ``run_experiment`` call left without a result stays open for ``observe``;
        any other unanswered call is answered as interrupted.
        """
        self._messages = plain(messages)
        self._open_call = None
        answered = {m.get("tool_call_id") for m in self._messages if m.get("role") == "tool"}
        for m in self._messages:
            if m.get("role") == "assistant":
                for call in m.get("tool_calls") or []:
                    if call.get("id") in answered:
                        continue
                    if call.get("function", {}).get("name") == RUN_TOOL:
                        self._open_call = call["id"]
                    else:
                        self._append_tool(call["id"], "not run: the session was interrupted before this call")

    # ------------------------------------------------------------------ Proposer protocol

    def propose(self, state: LoopState) -> Step | None:
        if self.stopped_reason is not None:
            return None
        t0 = time.monotonic()
        self._bind(state)
        tokens_at_start = self.tokens_used
        try:
            if not self._messages:
                self._messages = [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": opening_message(state, self.prompt_token_budget, self.client.secrets)},
                ]
            elif self._open_call is not None:
                # propose() again without observe(): the experiment never reported back.
                self._append_tool(self._open_call, "the experiment ended without a verdict (interrupted); "
                                                   "read_ledger shows what was recorded")
                self._open_call = None
            idle = 0
            while True:
                reason = self._cap_reached(t0)
                if reason:
                    return self._stop(reason)
                reply = self.client.chat(self._messages, self.registry.openai_tools())
                self.turns += 1
                self.tokens_used += reply.tokens
                message = reply.message
                self._messages.append(message)
                calls = message.get("tool_calls") or []
                if not calls:
                    idle += 1
                    if idle >= MAX_IDLE_REPLIES:
                        return self._stop(f"the model answered {idle} times without calling a tool")
                    self._messages.append({"role": "user", "content": NUDGE})
                    continue
                idle = 0
                step, call_id = self._run_calls(calls)
                if step is not None:
                    step = step.model_copy(update={"llm_tokens": self.tokens_used - tokens_at_start})
                    self._open_call = self.last_call_id = call_id
                    log.info("llm proposer: experiment proposed after %d model calls: %s",
                             self.turns, step.hypothesis.statement)
                    return step
                if self.ctx.finished is not None:
                    return self._stop(f"finished: {self.ctx.finished}")
        finally:
            self.wall_s += time.monotonic() - t0

    def observe(self, state: LoopState, experiment: Experiment) -> None:
        self._bind(state)
        text = experiment_result(experiment, RESULT_CHARS, self.client.secrets)
        if self._open_call is not None:
            self._append_tool(self._open_call, text)
            self._open_call = None
        elif self._messages:
            # An experiment this conversation did not propose (another proposer, a re-run).
            self._messages.append({"role": "user", "content": "An experiment finished outside this conversation:\n" + text})

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ internals

    def _bind(self, state: LoopState) -> None:
        self.ctx.state = state
        self.ctx.workspace = state.workspace
        root = state.code_root or getattr(state.workspace, "root", None) or Path.cwd()
        self.ctx.code_root = Path(root)

    def _submit(self, step: Step) -> None:
        self._submitted = step

    def _run_calls(self, calls: list[dict[str, Any]]) -> tuple[Step | None, str | None]:
        """Execute one reply's tool calls in order; (the submitted step, its call id)."""
        step: Step | None = None
        step_call: str | None = None
        for call in calls:
            call_id = str(call.get("id") or "")
            fn = call.get("function") or {}
            name = str(fn.get("name") or "")
            if step is not None or self.ctx.finished is not None:
                why = "run_experiment was called first" if step is not None else "finish was called first"
                self._append_tool(call_id, f"{name}: not run: {why} in the same reply; call it again later if needed")
                continue
            self._submitted = None
            result = self.registry.call(name, fn.get("arguments"), self.ctx)
            if result.error:
                log.info("llm proposer: tool %s refused: %s", name, result.text[:200])
            if name == RUN_TOOL and not result.error and self._submitted is not None:
                step, step_call = self._submitted, call_id
                continue  # its result is the verdict, added by observe()
            self._append_tool(call_id, result.text)
        return step, step_call

    def _append_tool(self, call_id: str, content: str) -> None:
        self._messages.append({"role": "tool", "tool_call_id": call_id, "content": content})

    def _cap_reached(self, t0: float) -> str | None:
        if self.turns >= self.max_turns:
            return f"max_turns reached ({self.turns} model calls)"
        if self.tokens_used >= self.max_tokens:
            return f"max_tokens reached ({self.tokens_used} tokens used, cap {self.max_tokens})"
        spent = self.wall_s + time.monotonic() - t0
        if spent >= self.max_wall_s:
            return f"max_wall_s reached ({spent:.0f} s in the model conversation, cap {self.max_wall_s:g} s)"
        return None

    def _stop(self, reason: str) -> Step | None:
        """Record why the session ends; what ``propose`` then returns (None)."""
        self.stopped_reason = reason
        log.info("llm proposer stops: %s", reason)
        return None

    def stats(self) -> dict[str, Any]:
        """Counters for the run record: model calls, tokens, wall time, why it stopped."""
        return {"turns": self.turns, "tokens": self.tokens_used, "wall_s": round(self.wall_s, 3),
                "stopped_reason": self.stopped_reason, "retries": self.client.retries}

    def __repr__(self) -> str:
        return f"LLMProposer(model={self.model!r}, base_url={self.base_url!r}, turns={self.turns})"

