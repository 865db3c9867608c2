"""tools.loadgen: agentic multi-turn load and soak tests for OpenAI-compatible servers.

Run ``python -m tools.loadgen --help``. The package imports only the standard library, aiohttp,
numpy and prometheus_client (matplotlib optionally), never torch or ftserve, so it can drive any
server from any machine.
"""

from tools.loadgen.cli import main

__all__ = ["main"]
