"""schemathesis over the served OpenAPI spec: no generated request may get a 5xx (opt-in; needs
`pip install -e ".[fuzz]"`, nothing else depends on schemathesis).

    python -m benchmark.fuzz_openapi --max-examples 60 --min-cases 2000

Starts `launch_server` with a random `--api-key` (the spec sits behind it) and a short
`--context-length` (every generated generation request stays short) and `--enable-metrics`
(so /metrics answers rather than 404s), runs `schemathesis run`
with the `not_a_server_error` check over every operation, stops the server, prints the case
count and the failures, and exits non-zero below `--min-cases` or on any failure.
"""

from __future__ import annotations

import argparse
import re
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from benchmark.common import stop_children_on_sigterm
from benchmark.sweep_serving import server


def run_schemathesis(url: str, api_key: str, args: argparse.Namespace) -> tuple[int, int, str]:
    """(cases generated, cases failed, schemathesis output)."""
    exe = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    cmd = [exe, "run", f"{url}/openapi.json", "-H", f"Authorization: Bearer {api_key}",
           "--checks", "not_a_server_error", "-n", str(args.max_examples), "--no-color",
           "--seed", str(args.seed), "--generation-database", "none",
           "--request-timeout", str(args.request_timeout), "--workers", str(args.workers)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    m = re.search(r"(\d+) generated", out)
    failed = re.search(r"(\d+) failed", out)
    return int(m.group(1)) if m else 0, int(failed.group(1)) if failed else 0, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-examples", type=int, default=60, help="cases per operation")
    p.add_argument("--min-cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--server-args", default="--context-length 256 --enable-metrics")
    p.add_argument("--output", default="results/fuzz_openapi.txt")
    args = p.parse_args(argv)
    api_key = secrets.token_hex(16)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with server([*shlex.split(args.server_args), "--api-key", api_key],
                out_path.with_suffix(".server.log")) as url:
        cases, failed, text = run_schemathesis(url, api_key, args)
    out_path.write_text(text)
    print(text[-3000:])
    print(f"fuzz_openapi: {cases} cases, {failed} failed (not_a_server_error), "
          f"log {out_path}")
    return 0 if failed == 0 and cases >= args.min_cases else 1


if __name__ == "__main__":
    stop_children_on_sigterm()
    raise SystemExit(main())
