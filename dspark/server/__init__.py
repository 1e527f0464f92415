"""The OpenAI-compatible HTTP server (needs the `server` extra: fastapi, uvicorn, prometheus-client).

Import direction: server -> engine.  `build_app` is the FastAPI factory; `add_serve_args` and
`run_serve` back `dspark serve`; `ServerThread` runs a server in the background (tests).
Names resolve lazily so that building the command line parser imports neither FastAPI nor torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_app": "dspark.server.api_server",
    "AsyncEngine": "dspark.server.async_engine",
    "QueueFull": "dspark.server.async_engine",
    "RequestFailed": "dspark.server.async_engine",
    "ServerThread": "dspark.server.launch",
    "add_serve_args": "dspark.server.launch",
    "engine_config_from_args": "dspark.server.launch",
    "run_serve": "dspark.server.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dspark.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
