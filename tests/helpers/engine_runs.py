"""Running a prompt set through a `runtime.Engine` the ways the equality tests compare."""

from __future__ import annotations

import asyncio


def run_concurrent(engine, prompts: list[list[int]], params: list[dict], concurrency: int
                   ) -> list[dict]:
    """Every prompt (with its own sampling params), at most `concurrency` in flight."""
    async def main():
        sem = asyncio.Semaphore(concurrency)

        async def one(p, sp):
            async with sem:
                return await engine.async_generate(input_ids=p, sampling_params=sp)

        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))

    return asyncio.run(main())


def alone_then_eight(engine, prompts: list[list[int]], params: list[dict]
                     ) -> tuple[list[tuple[int, dict]], list[dict]]:
    """Every other prompt one at a time, then all of them eight at a time (the suite's time is
    mostly these passes): ([(prompt index, output)] of the lone runs, the concurrent outputs)."""
    alone = [(i, engine.generate(input_ids=prompts[i], sampling_params=params[i]))
             for i in range(0, len(prompts), 2)]
    return alone, run_concurrent(engine, prompts, params, 8)
