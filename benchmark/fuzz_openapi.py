"""schemathesis over the served OpenAPI spec: no generated request may get a 5xx.

    python -m benchmark.fuzz_openapi --max-examples 60 --min-cases 2000 --seed 7

Starts `launch_server` with a random `--api-key` (the spec sits behind it), a short
`--context-length` and `--max-sequences-per-request` (the spec states both: every generated
request stays short), `--enable-metrics` (so /metrics answers rather than 404s) and NGRAM
speculation, runs `schemathesis run` with the `not_a_server_error` check over every operation,
stops the server, prints the case count, the failures (each as a curl line), schemathesis's
warnings and the server's logged errors, and exits non-zero below `--min-cases`, on any
failure, on a "Schema validation mismatch" warning (the spec and the server's validation
disagree), or when the server logged an error. The suite runs a short pass of the same
(tests/integration/test_fuzz_openapi.py).
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
from typing import NamedTuple

from benchmark.common import stop_children_on_sigterm
from benchmark.sweep_serving import server

# a short context and few sequences per request keep every generated generation short
SERVER_ARGS = ("--context-length 256 --max-sequences-per-request 8 --enable-metrics "
               "--speculative-algorithm NGRAM --speculative-verify-cost table")
MISMATCH = "Schema validation mismatch"
ALL_PHASES = "examples,coverage,fuzzing,stateful"


class FuzzResult(NamedTuple):
    cases: int  # test cases schemathesis generated and sent
    failures: int  # cases that failed `not_a_server_error` (a 5xx)
    curls: list[str]  # each failure as a curl command line
    warnings: list[str]  # schemathesis's warning titles (e.g. MISMATCH)
    output: str

    @property
    def ok(self) -> bool:
        return self.failures == 0 and MISMATCH not in self.warnings


def run_schemathesis(url: str, api_key: str | None, max_examples: int, seed: int,
                     phases: str = ALL_PHASES, workers: int = 1, request_timeout: float = 120,
                     include_path: str | None = None) -> FuzzResult:
    """One seeded schemathesis run over `url`'s spec, checking only that no case gets a 5xx."""
    exe = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    # (unsanitized output: its curl lines reproduce a case; the key is a throwaway one)
    cmd = [exe, "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
           "-n", str(max_examples), "--no-color", "--seed", str(seed), "--output-sanitize", "false",
           "--generation-database", "none", "--phases", phases,
           "--request-timeout", str(request_timeout), "--workers", str(workers)]
    if api_key:
        cmd += ["-H", f"Authorization: Bearer {api_key}"]
    if include_path:
        cmd += ["--include-path", include_path]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    generated = re.search(r"(\d+) generated", out)
    failed = re.search(r"(\d+) (?:found \d+ unique failures?|failed)", out)
    failures = int(failed.group(1)) if failed else 0
    if proc.returncode and not failures and MISMATCH not in out:
        failures = 1  # schemathesis itself failed (a spec it could not load, a crash)
    curls = [line.strip() for line in out.splitlines() if line.strip().startswith("curl ")]
    warnings = [w for w in (MISMATCH, "Missing test data", "Low valid rate") if w in out]
    return FuzzResult(int(generated.group(1)) if generated else 0, failures, curls, warnings,
                      out)


def logged_errors(server_log: str) -> list[str]:
    """The server's ERROR lines (ours and uvicorn's): a bug even when the client got an
    answer."""
    return [line for line in server_log.splitlines() if " ERROR " in line or
            line.startswith("ERROR:")]


def summary(result: FuzzResult) -> str:
    lines = [f"fuzz_openapi: {result.cases} cases, {result.failures} server errors "
             "(not_a_server_error)"]
    lines += [f"  {c}" for c in result.curls]
    lines += [f"  warning: {w}" for w in result.warnings]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-examples", type=int, default=60, help="cases per operation")
    p.add_argument("--min-cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--phases", default=ALL_PHASES)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--server-args", default=SERVER_ARGS)
    p.add_argument("--output", default="results/fuzz_openapi.txt")
    args = p.parse_args(argv)
    api_key = secrets.token_hex(16)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_path.with_suffix(".server.log")
    with server([*shlex.split(args.server_args), "--api-key", api_key], log_path) as url:
        result = run_schemathesis(url, api_key, args.max_examples, args.seed, args.phases,
                                  args.workers, args.request_timeout)
    out_path.write_text(result.output)
    errors = logged_errors(log_path.read_text())
    print(result.output[-3000:])
    print(summary(result), f"\nserver log: {len(errors)} error lines", *errors[:10],
          f"\nlog {out_path}", sep="\n")
    return 0 if result.ok and not errors and result.cases >= args.min_cases else 1


if __name__ == "__main__":
    stop_children_on_sigterm()
    raise SystemExit(main())
