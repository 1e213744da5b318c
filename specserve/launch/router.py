"""sglang-router (PyPI `sglang-router`, a Rust binary) in front of the replicas of `--dp-size`:
its command line, and its worker API (`/workers`), through which the launcher takes a dead
replica out of the rotation and puts it back once restarted."""

from __future__ import annotations

import importlib.util
import sys
import time

import httpx

INSTALL_HINT = "pip install sglang-router"
# our --log-level -> the router's; at info it logs two lines per request
_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}


class RouterUnavailable(RuntimeError):
    pass


def require_router() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise RouterUnavailable(f"--dp-size > 1 needs sglang-router: {INSTALL_HINT}")


def router_command(worker_urls: list[str], host: str, port: int, metrics_port: int,
                   api_key: str | None, log_level: str) -> list[str]:
    """`python -m sglang_router.launch_router ...` for these workers. With `api_key`, the router
    asks clients for it (401 without; /health stays open) and sends it to the workers."""
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
        "--policy", "cache_aware", "--host", host, "--port", str(port),
        # its metrics listen on 0.0.0.0:29000 by default: one port per router, and local
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", _LOG_LEVELS[log_level],
        "--worker-startup-check-interval", "1",
        # a server finishes its requests within 3 s of a SIGTERM too (180 s by default)
        "--shutdown-grace-period-secs", "3",
        # The launcher takes a replica that exits out of the rotation within milliseconds
        # (specserve/launch/data_parallel.py), and the router tries a failed request again (5 tries,
        # a worker picked each time: this widens the span of the tries from 0.4 s to 0.8 s),
        # so a request sent to a replica that has just died, or in flight on it unstreamed, is
        # answered by another. The circuit breaker stays off: it counts 4xx answers as
        # failures, so a client's invalid requests in a row would take a healthy replica out.
        "--retry-initial-backoff-ms", "100", "--disable-circuit-breaker",
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def connect_host(host: str) -> str:
    """Where a local client reaches a server bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class RouterClient:
    """The router's worker API: GET /workers, DELETE /workers/{id}, POST /workers (both
    queued by the router and applied within milliseconds)."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=5)

    def workers(self) -> dict[str, dict]:
        """Worker URL -> the router's record of it (`id`, `is_healthy`, `load`, ...)."""
        resp = self.http.get("/workers")
        resp.raise_for_status()
        return {w["url"]: w for w in resp.json()["workers"]}

    def remove(self, worker_url: str) -> None:
        worker = self.workers().get(worker_url)
        if worker is not None:
            self.http.delete(f"/workers/{worker['id']}").raise_for_status()

    def add(self, worker_url: str) -> None:
        if worker_url in self.workers():  # its removal failed: it is still there
            return
        # the key goes with the worker: without it the router reads the worker's model facts
        # unauthenticated (401) and warns
        body = {"url": worker_url, **({"api_key": self.api_key} if self.api_key else {})}
        self.http.post("/workers", json=body).raise_for_status()

    def wait_workers(self, worker_urls: list[str], is_alive, timeout_s: float) -> None:
        """Until every worker is listed healthy; RuntimeError if `is_alive()` turns False
        (the router exited) or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not is_alive():
                raise RuntimeError("sglang-router exited during start-up (its log is above)")
            try:
                listed = self.workers()
                if all(listed.get(u, {}).get("is_healthy") for u in worker_urls):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router did not list the replicas within "
                                   f"{timeout_s:.0f}s")
            time.sleep(0.2)

    def close(self) -> None:
        self.http.close()
