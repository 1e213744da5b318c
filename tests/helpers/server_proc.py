"""Start a real `python -m launch_server` subprocess for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmark.common import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    """Every live process whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, timeout_s: float = 240) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "launch_server", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = Path(f"/tmp/specserve-test-{self.port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self.proc, timeout_s)
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"{exc}:\n{self.read_log()}") from None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def read_log(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kw)

    def server_info(self) -> dict:
        with self.client() as c:
            return c.get("/server_info").json()

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.server_info()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {info}")
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode
