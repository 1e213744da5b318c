"""Running a prompt set through an `Engine` (specserve/launch/engine.py) the ways the equality tests
compare."""

from __future__ import annotations

import asyncio


def run_concurrent(engine, prompts: list[list[int]], params: list[dict], concurrency: int,
                   extra: list[dict] | None = None) -> list[dict]:
    """Every prompt (with its own sampling params, and `extra[i]` keyword arguments such as
    the logprob ones), at most `concurrency` in flight."""
    extra = extra or [{}] * len(prompts)

    async def main():
        sem = asyncio.Semaphore(concurrency)

        async def one(p, sp, kw):
            async with sem:
                return await engine.async_generate(input_ids=p, sampling_params=sp, **kw)

        return await asyncio.gather(*(one(p, sp, kw)
                                      for p, sp, kw in zip(prompts, params, extra)))

    return asyncio.run(main())


def alone_then_eight(engine, prompts: list[list[int]], params: list[dict],
                     extra: list[dict] | None = None
                     ) -> tuple[list[tuple[int, dict]], list[dict]]:
    """Every other prompt one at a time, then all of them eight at a time (the suite's time is
    mostly these passes): ([(prompt index, output)] of the lone runs, the concurrent outputs)."""
    extra = extra or [{}] * len(prompts)
    alone = [(i, engine.generate(input_ids=prompts[i], sampling_params=params[i], **extra[i]))
             for i in range(0, len(prompts), 2)]
    return alone, run_concurrent(engine, prompts, params, 8, extra)


def second_while_first_runs(engine, prompts: list[list[int]], params: dict
                            ) -> list[tuple[dict, dict]]:
    """Per prompt, one request streamed and, once it has its first token (its prompt then in
    the prefix cache), a second with the same prompt: (first's final chunk, second's output).
    The second takes its prompt from a request that is still decoding."""

    async def pair(p):
        stream = await engine.async_generate(input_ids=p, sampling_params=params, stream=True)
        last = await stream.__anext__()  # chunks are cumulative: the last one is the output
        second = asyncio.ensure_future(engine.async_generate(input_ids=p,
                                                             sampling_params=params))
        async for chunk in stream:
            last = chunk
        return last, await second

    async def main():
        return [await pair(p) for p in prompts]

    return asyncio.run(main())
