"""benchmark.common.wait_healthy: the start-up poller every benchmark and server test uses."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from benchmark.common import free_port, wait_healthy

# answers /health with 503 twice, then 200 (a server still starting, then ready)
SERVER = textwrap.dedent("""
    import http.server, sys
    calls = []
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            calls.append(self.path)
            ok = self.path == "/health" and len(calls) > 2
            self.send_response(200 if ok else 503)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_waits_through_refusals_and_503s_until_200():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    try:
        took = wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=30, interval_s=0.05)
        assert 0 < took < 30
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_exits_or_never_answers_is_an_error():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(RuntimeError, match=r"exit code 3\); log: srv\.log"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout_s=30, interval_s=0.05,
                     log="srv.log")
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(RuntimeError, match="not healthy after"):
            wait_healthy(f"http://127.0.0.1:{free_port()}", idle, timeout_s=0.3, interval_s=0.05)
    finally:
        idle.kill()
        idle.wait()
