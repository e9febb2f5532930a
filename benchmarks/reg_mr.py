"""Time ``reg_mr`` over buffers from 1 KiB to 1 GiB: registering never copies.

    python benchmarks/reg_mr.py [--max-gib 1] [--repeat 9]

Each size is registered and deregistered ``--repeat`` times; the median is
printed beside the time to make a ``memoryview`` of the same buffer (the
least any zero-copy registration can cost) and the time to copy it once
(what a copying registration would cost), both measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import trio

import rdmashim
from rdmashim import Access


def _median_ns(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t)
    return statistics.median(samples)


async def main(max_gib: float, repeat: int) -> None:
    sizes = [1 << 10, 1 << 20, 64 << 20, int(max_gib * (1 << 30))]
    async with rdmashim.open_device("siw_lo") as ctx:
        pd = ctx.alloc_pd()
        access = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
        print(f"{'size':>12}  {'reg_mr+dereg':>14}  {'memoryview':>12}  {'one copy':>12}")
        for size in sizes:
            buf = bytearray(size)
            reg = _median_ns(lambda b=buf: pd.reg_mr(b, access).close(), repeat)
            view = _median_ns(lambda b=buf: memoryview(b).release(), repeat)
            copy = _median_ns(lambda b=buf: bytes(b), max(1, min(repeat, 3)))
            print(
                f"{size:>12}  {reg / 1e3:>11.1f} us  {view / 1e3:>9.1f} us  {copy / 1e6:>9.1f} ms"
            )
            del buf


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    trio.run(main, args.max_gib, args.repeat)
