# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The gate's KV budget: with one KV cache shared by all slots (``--kv-unified``), llama-server fails every request
in flight at once when the busy slots together outgrow the cache ("Context size has been exceeded",
``server-context.cpp``: it has no way to end only one). So the gate admits a generation only when its tokens fit
beside those of the generations in flight: its prompt, counted by llama-server itself (a chat's through its
``input_tokens`` route, which applies the chat template as the chat route does; a plain prompt through ``/tokenize``),
plus the most it may generate (``max_tokens``, ``max_completion_tokens``, ``n_predict`` or ``max_output_tokens``, else
the server's ``-n``, else the whole cache). The others wait their turn, first come first served, up to the request
timeout. A generation the gate cannot count (``/infill``, or a build without the counting route) runs alone.

Part of the serving gate (see serving_gate.py for the map of its modules); stdlib only, runs on the hosts.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

# The generation routes of llama-server 0c1e570 (tools/server/server.cpp) whose body the gate reads: those whose
# prompt llama-server counts for the asking (chat, responses and Anthropic messages: the chat template applied to the
# messages; route -> its counting route, which answers {"input_tokens": N}), plain completion (the prompt as given,
# counted by /tokenize), and the one the gate cannot count (fill-in-the-middle, which runs alone).
COUNTED_PATHS = {"/chat/completions": "/chat/completions/input_tokens",
                 "/v1/chat/completions": "/v1/chat/completions/input_tokens",
                 "/responses": "/responses/input_tokens", "/v1/responses": "/v1/responses/input_tokens",
                 "/v1/messages": "/v1/messages/count_tokens"}
COMPLETION_PATHS = frozenset(("/completion", "/completions", "/v1/completions"))
ALONE_PATHS = frozenset(("/infill",))
BUDGET_PATHS = frozenset(COUNTED_PATHS) | COMPLETION_PATHS | ALONE_PATHS
# A counting route's answer that says the build has no such route: the generation then runs alone.
NO_ROUTE = (404, 405, 501)
# The request fields that bound a generation, and those that ask for several answers, in llama-server's order of
# precedence (server-schema.cpp: a field, then its aliases; the responses API's own name last).
LIMIT_KEYS = ("n_predict", "max_completion_tokens", "max_tokens", "max_output_tokens")
COPIES_KEYS = ("n_cmpl", "n")
# The most body the gate reads to count a generation's tokens (llama-server's own HTTP limit is larger; a bigger
# body is answered 413).
MAX_BUDGET_BODY = 32 * 1024 * 1024
# Tokens added to each counted prompt. llama-server tokenizes a prompt as /tokenize does here (add_special and
# parse_special on, the chat template's text for a chat), and a slot holds the prompt and the generated tokens but
# the last (sampled, never decoded); one more token covers an off-by-one between the two.
PROMPT_MARGIN = 1


class BudgetError(Exception):
    """The request cannot be counted (the gate answers ``status`` with the message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Cost:
    """A generation's tokens: ``prompt`` (counted), ``generate`` (its bound; None: none given), ``copies`` (``n``
    choices or several prompts), and ``tokens``, what the gate reserves, at most the whole cache."""

    prompt: int
    generate: int | None
    copies: int
    tokens: int


def generation_limit(body: dict[str, Any], default: int) -> int | None:
    """The most tokens the request may generate: its own bound, else ``default`` (the server's ``-n``; 0 or less:
    none), None when unbounded."""
    for key in LIMIT_KEYS:
        value = body.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if value >= 0:
            return value
        break  # -1 asks for no bound
    return default if default > 0 else None


def copies(body: dict[str, Any]) -> int:
    """``n_cmpl`` (or ``n``): how many answers llama-server generates for each prompt, each in a slot of its own."""
    for key in COPIES_KEYS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return max(value, 1)
    return 1


def cost_of(prompt_tokens: int, body: dict[str, Any], capacity: int, default_limit: int, prompts: int = 1) -> Cost:
    """The reservation for ``prompt_tokens`` (over ``prompts`` prompts) and the body's generation bound."""
    limit = generation_limit(body, default_limit)
    count = copies(body) * max(prompts, 1)
    if limit is None:
        tokens = capacity
    else:
        tokens = min(capacity, prompt_tokens * copies(body) + PROMPT_MARGIN * count + limit * count)
    return Cost(prompt_tokens, limit, count, tokens)


def decode_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object; BudgetError(400) otherwise (llama-server would refuse it too)."""
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BudgetError(400, "the request body is not JSON: %s" % exc) from None
    if not isinstance(value, dict):
        raise BudgetError(400, "the request body must be a JSON object")
    return value


Upstream = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


async def prompt_tokens(path: str, body: dict[str, Any], upstream: Upstream) -> tuple[int, int]:
    """(tokens, prompts) of the request's prompt, counted by llama-server: ``upstream(path, json)`` posts to it and
    returns its JSON answer (raising BudgetError when it refuses)."""
    if path in COUNTED_PATHS:
        answer = await upstream(COUNTED_PATHS[path], body)
        tokens = answer.get("input_tokens")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise BudgetError(502, "llama-server's %s answered without input_tokens" % COUNTED_PATHS[path])
        return tokens, 1
    prompt = body.get("prompt", body.get("content", ""))
    if isinstance(prompt, str):
        return await _count(prompt, upstream), 1
    if isinstance(prompt, list) and prompt and all(isinstance(item, int) and not isinstance(item, bool)
                                                   for item in prompt):
        return len(prompt), 1
    if isinstance(prompt, list) and prompt:
        total = 0
        for item in prompt:
            if isinstance(item, str):
                total += await _count(item, upstream)
            elif isinstance(item, list):
                total += len(item)
            else:
                raise BudgetError(400, "prompt items must be strings or lists of tokens")
        return total, len(prompt)
    raise BudgetError(400, "the request has no prompt the gate can count (a string or a list)")


async def _count(text: str, upstream: Upstream) -> int:
    answer = await upstream("/tokenize", {"content": text, "add_special": True, "parse_special": True})
    tokens = answer.get("tokens")
    if not isinstance(tokens, list):
        raise BudgetError(502, "llama-server's /tokenize answered without tokens")
    return len(tokens)


class _Waiter:
    def __init__(self, tokens: int, future: asyncio.Future) -> None:  # type: ignore[type-arg]
        self.tokens = tokens
        self.future = future


class TokenBudget:
    """``capacity`` KV cells shared by the generations in flight; ``acquire`` waits, first come first served, until
    ``tokens`` fit beside the others, ``release`` gives them back."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a token budget needs a capacity of at least 1, got %r" % capacity)
        self.capacity = capacity
        self.reserved = 0
        self._queue: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def acquire(self, tokens: int) -> int:
        """Reserve ``tokens`` (at most the capacity); returns what was reserved, to give to release. A cancelled
        wait reserves nothing."""
        tokens = max(1, min(tokens, self.capacity))
        if not self._queue and self.reserved + tokens <= self.capacity:
            self.reserved += tokens
            return tokens
        waiter = _Waiter(tokens, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(tokens)  # admitted in the same turn as the cancel: give it back
            else:
                if waiter in self._queue:
                    self._queue.remove(waiter)
                self._wake()
            raise
        return tokens

    def release(self, tokens: int) -> None:
        """Give back what acquire reserved, and admit the waiters that now fit, in order."""
        self.reserved = max(0, self.reserved - tokens)
        self._wake()

    def _wake(self) -> None:
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # a cancelled wait, not yet taken out by its own task
                self._queue.popleft()
                continue
            if self.reserved + head.tokens > self.capacity:
                break
            self._queue.popleft()
            self.reserved += head.tokens
            head.future.set_result(None)
