"""The serving gate's proxy over real loopback sockets, in front of a stand-in llama-server: one harness for the gate's
unit tests (test_serving_gate.py, test_gate_budget.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable

from llamafleet.core.gate_config import Config
from llamafleet.core.gate_decision import SERVING
from llamafleet.core.gate_proxy import Gate


class LoopbackServer:
    """A stand-in server on 127.0.0.1 (a free port); ``handle(reader, writer)`` serves each connection."""

    server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


def run_gate(scenario: Callable[[Gate, Any], Awaitable[None]], upstream: Any, base: Config, timeout: float,
             **cfg: Any) -> None:
    """Start ``upstream`` (``await start()`` gives its port, ``server`` its asyncio server), a gate in front of it
    serving (``base`` with ``cfg``, a deadline of 2 s unless ``cfg`` sets one, listening on a free loopback port), run ``scenario(gate, upstream)`` within
    ``timeout`` seconds, and stop both."""

    async def main() -> None:
        port = await upstream.start()
        gate = Gate(dataclasses.replace(base, listen_host="127.0.0.1", listen_port=0, upstream_port=port,
                                        **{"deadline": 2.0, **cfg}))
        await gate.start()
        gate.set_state(SERVING, "llama-server is serving")
        try:
            await asyncio.wait_for(scenario(gate, upstream), timeout)
        finally:
            await gate.stop(grace=0.1)
            assert upstream.server is not None
            upstream.server.close()

    asyncio.run(main())
