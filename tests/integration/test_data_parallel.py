"""`--dp-size 2`: two replicas of the default model behind the real sglang-router on loopback.
Requests are all answered with a replica's own greedy output, prompts sharing a prefix meet
one prefix cache, a replica killed under load is restarted while the other keeps answering,
and SIGTERM leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.server_proc import ServerProcess, children_of, pid_alive

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e "
                    "'.[dev]')")
pytestmark = pytest.mark.slow

WORDS = ["Oceans", "Bicycles", "Volcanoes", "Chess", "Bread", "Moonlight", "Rainforests",
         "Trains", "Honeybees", "Glaciers", "Jazz", "Libraries", "Coffee", "Deserts",
         "Penguins", "Lighthouses", "Kites", "Maps", "Owls", "Pianos", "Quartz", "Rivers",
         "Saturn", "Tulips", "Umbrellas", "Violins", "Whales", "Xylophones", "Yachts",
         "Zebras", "Airports", "Bridges"]
GREEDY = {"max_new_tokens": 24, "temperature": 0}
RESTART_BOUND_S = 120


def prompt(i: int) -> str:
    # distinct from the first character on, so the router's prefix match does not tie them
    return f"{WORDS[i % len(WORDS)]} {i}: write two sentences about them."


@pytest.fixture(scope="module")
def dp():
    srv = ServerProcess("--dp-size", "2", "--enable-metrics", "--log-level", "info")
    yield srv
    srv.stop()


def replica_urls(srv) -> list[str]:
    workers = httpx.get(f"{srv.url}/workers", timeout=10).json()["workers"]
    return sorted(w["url"] for w in workers)


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def replica_pid(srv, url: str) -> int | None:
    """The pid of the replica (a child of the launcher) serving `url`."""
    port = url.rsplit(":", 1)[1]
    for pid in children_of(srv.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"launch_server" in b" ".join(argv) and port.encode() in argv:
            return pid
    return None


def back_in_the_router(srv, url: str, old_pid: int) -> bool:
    new_pid = replica_pid(srv, url)
    if not new_pid or new_pid == old_pid or url not in replica_urls(srv):
        return False
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


async def post_all(url: str, bodies: list[dict], path: str = "/generate") -> list:
    async with httpx.AsyncClient(timeout=300) as c:
        async def one(body):
            try:
                return await c.post(url + path, json=body)
            except httpx.HTTPError as exc:
                return exc
        return await asyncio.gather(*(one(b) for b in bodies))


def test_32_concurrent_requests_are_answered_with_a_replicas_own_output(dp):
    urls = replica_urls(dp)
    assert len(urls) == 2
    served = [counter(u, "specserve_requests_total") for u in urls]
    bodies = [{"text": prompt(i), "sampling_params": GREEDY} for i in range(32)]
    routed = asyncio.run(post_all(dp.url, bodies))
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in routed), \
        [getattr(r, "text", r) for r in routed if getattr(r, "status_code", 0) != 200][:3]
    per_replica = [counter(u, "specserve_requests_total") - s for u, s in zip(urls, served)]
    assert sum(per_replica) == 32 and min(per_replica) > 0, per_replica  # both replicas serve
    direct = asyncio.run(post_all(urls[0], bodies))
    assert [r.json()["text"] for r in routed] == [r.json()["text"] for r in direct]


def test_requests_sharing_a_long_prefix_meet_one_replicas_prefix_cache(dp):
    urls = replica_urls(dp)
    prefix = ("Reference manual, chapter 7. The pump station keeps the reservoir between "
              "four and six metres; operators log the level every hour, open the spillway "
              "above six metres and call the duty engineer when the inflow gauge reads more "
              "than forty litres a second. ") * 6
    bodies = [{"text": f"{prefix}Question {i}: what does an operator do at {i + 3} metres?",
               "sampling_params": {**GREEDY, "max_new_tokens": 8}} for i in range(8)]
    before = [counter(u, "specserve_cached_tokens_total") for u in urls]
    first = asyncio.run(post_all(dp.url, bodies[:1]))
    prefix_tokens = 0.9 * first[0].json()["meta_info"]["prompt_tokens"]  # less the question
    for pair in (bodies[1:3], bodies[3:5], bodies[5:7], bodies[7:]):
        assert all(r.status_code == 200 for r in asyncio.run(post_all(dp.url, pair)))
    hits = sorted(counter(u, "specserve_cached_tokens_total") - b for u, b in zip(urls, before))
    # the seven requests after the first reuse its prefix, and on one replica only
    assert hits[1] >= 6 * prefix_tokens, (hits, prefix_tokens)
    assert hits[0] <= 0.05 * hits[1], hits


def test_a_replica_killed_under_load_is_restarted_while_the_other_answers(dp):
    urls = replica_urls(dp)
    pids = {u: replica_pid(dp, u) for u in urls}
    assert all(pids.values()), pids

    async def load() -> tuple[list, list, int, str]:
        async with httpx.AsyncClient(timeout=300) as c:
            async def one(i):
                body = {"text": prompt(i), "sampling_params": {
                    "max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
                try:
                    return (await c.post(f"{dp.url}/generate", json=body)).status_code
                except httpx.HTTPError as exc:
                    return repr(exc)
            before = [asyncio.create_task(one(i)) for i in range(16)]
            # the victim: a replica with requests running on it
            deadline = time.monotonic() + 30
            while True:
                infos = {u: (await c.get(f"{u}/server_info")).json() for u in urls}
                busy = [u for u in urls if infos[u]["num_running_reqs"] > 0]
                if busy or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert busy, "no replica was running a request"
            victim = busy[0]
            in_flight = infos[victim]["num_running_reqs"] + infos[victim]["num_waiting_reqs"]
            tree = [pids[victim], *children_of(pids[victim])]
            for pid in tree:
                os.kill(pid, signal.SIGKILL)
            after = []
            for i in range(16, 40):  # the service keeps being asked while the victim is down
                after.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0.1)
            return (await asyncio.gather(*before), await asyncio.gather(*after), in_flight,
                    victim)

    before, after, in_flight, victim = asyncio.run(load())
    assert after == [200] * len(after), after
    lost = [r for r in before if r != 200]
    assert len(lost) <= in_flight, (lost, in_flight)  # only requests on the victim may fail
    deadline = time.monotonic() + RESTART_BOUND_S
    while not back_in_the_router(dp, victim, pids[victim]):
        assert time.monotonic() < deadline, f"{victim} not back after {RESTART_BOUND_S}s"
        time.sleep(0.5)
    assert not pid_alive(pids[victim])
    body = {"text": prompt(1), "sampling_params": {**GREEDY, "ignore_eos": True}}
    restarted, other = (httpx.post(f"{u}/generate", json=body, timeout=60).json()["output_ids"]
                        for u in (victim, next(u for u in urls if u != victim)))
    assert len(restarted) == GREEDY["max_new_tokens"] and restarted == other
    assert "is back in the router" in dp.read_log()


def test_sigterm_stops_the_router_and_every_replica(dp):
    tree = []
    for pid in children_of(dp.proc.pid):
        tree += [pid, *children_of(pid)]
    assert len(tree) >= 7, tree  # the router + 2 x (replica, scheduler, model runner)
    assert dp.stop() == 0, dp.read_log()[-3000:]
    time.sleep(0.5)
    assert not [p for p in tree if pid_alive(p)], "processes left behind"
