"""Hold ``concurrency`` greedy completions in flight against a server for
``seconds``, in a process of its own, so the load does not compete with an
in-process test server for the GIL (sixteen client threads in the server's
process tripled its step times and hid the compute-bound regime).

    python tests/hold_load.py URL CONCURRENCY SECONDS MAX_TOKENS [STOP_FILE] < prompts.json

Prompts are token-id lists (JSON). No new request starts once ``seconds`` have
passed or ``STOP_FILE`` exists (the test saw what it waited for); requests in
flight finish. Prints {"done": completed requests}; exits non-zero on the
first failed request.
"""

import asyncio
import json
import sys
import time
from pathlib import Path

import openai


async def hold(
    url: str, prompts: list[list[int]], concurrency: int, seconds: float, max_tokens: int, stop_file: Path | None
) -> int:
    deadline, done = time.monotonic() + seconds, 0

    def go_on() -> bool:
        return time.monotonic() < deadline and not (stop_file and stop_file.exists())

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:

        async def worker(first: int) -> None:
            nonlocal done
            i = first
            while go_on():
                await client.completions.create(
                    model="target", prompt=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=0
                )
                done += 1
                i += concurrency

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done


if __name__ == "__main__":
    url, concurrency, seconds, max_tokens = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    stop = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    print(json.dumps({"done": asyncio.run(hold(url, json.load(sys.stdin), concurrency, seconds, max_tokens, stop))}))
