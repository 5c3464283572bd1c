"""What `strata serve` was asked for (ServeConfig) and the keys the application keeps its parts under: the config,
the engine worker, the metrics, the start time and the error shapes of the routes' APIs."""
from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from strata.serve.connections import ConnectionGuard
from strata.serve.metrics import Metrics
from strata.serve.worker import EngineWorker


@dataclass
class ServeConfig:
    """What `strata serve` was asked for (the parsed flags that matter to the app)."""
    socket_path: str | None = None
    host: str | None = None
    port: int | None = None
    api_key: str | None = None
    queue_max: int = 16
    max_body: int = 8 * 1024 * 1024
    retry_after: int = 1
    drain_timeout: float = 30.0
    responses_store: int = 256        # /v1/responses kept for previous_response_id (strata.serve.responses_api)
    responses_store_mib: int = 256    # --responses-store-mib: their bytes at most
    aliases: tuple[str, ...] = ()     # --alias: more names of the loaded model in /v1/models
    embeddings: bool = False          # --embeddings: the embedding routes answer (else 501 naming the flag)
    pooling: str | None = None        # --pooling: the embedding routes' pooling (None: the model's, strata.engine.embed)
    n_predict: int = 1024             # --n-predict: an answer's length when a request gives none (-1: no limit)
    max_connections: int = 256        # --max-connections: open connections per listener (strata.serve.connections)
    header_timeout: float = 15.0      # --header-timeout: seconds from a request's first byte to its whole header
    body_timeout: float = 60.0        # --body-timeout: seconds for a request's whole body
    idle_timeout: float = 60.0        # --idle-timeout: seconds a connection may wait between requests
    max_request_seconds: float = 0.0  # --max-request-seconds: a generation's wall-time budget (0: none)
    max_request_tokens: int = 65536   # --max-request-tokens: n x max_tokens a request may ask for
    allowed_hosts: tuple[str, ...] = ()   # --allowed-hosts: Host names the TCP listener answers besides loopback
    cors_origins: tuple[str, ...] = ()    # --cors-origin: origins whose pages may call the API across origins
    stall_seconds: float = 600.0      # /health: 503 when no forward call returned for longer while work waits
    tcp_bound: str | None = None      # the TCP address actually bound ("[::1]:8090"; --port 0 gives the real port)

    def tcp_address(self) -> str | None:
        """host:port the TCP listener has (the bound one once known; IPv6 hosts in brackets), or None."""
        if self.port is None:
            return None
        if self.tcp_bound:
            return self.tcp_bound
        return format_hostport(self.host or "127.0.0.1", self.port)


def format_hostport(host: str, port: int) -> str:
    """host:port, with an IPv6 host in brackets ([::1]:8080), as URLs write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


CONFIG_KEY = web.AppKey("config", ServeConfig)
WORKER_KEY = web.AppKey("worker", EngineWorker)
METRICS_KEY = web.AppKey("metrics", Metrics)
STARTED_KEY = web.AppKey("started", float)
GUARD_KEY = web.AppKey("connections", ConnectionGuard)
# route template -> the error body of that route's API (ApiError -> dict); a key ending in '/' is a prefix: the shape of
# paths under it that no route matches; routes not in it answer OpenAI's shape
ERROR_SHAPES_KEY = web.AppKey("error_shapes", dict)
