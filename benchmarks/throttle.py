"""A rate-limiting TCP proxy on 127.0.0.1: one node's network link, for every client alike.

    python benchmarks/throttle.py --target 127.0.0.1:PORT --rate 12.5M [--delay 0.035] [--port 0] [--stats FILE]

Every connection accepted on the listening port is forwarded to ``--target``. All connections
through one proxy share one token bucket per direction (upload: client -> target, download:
target -> client), each at ``--rate`` bytes per second: the proxy models the link of one node (a
trainer or a rollout node), however many parallel connections its client opens. Run one proxy per
node. ``--delay`` adds a one-way latency to each direction (half a round trip between regions),
which costs every request a client asks in sequence a round trip, as across regions. The listening
port is printed on stdout (one line) once it accepts connections. With ``--stats FILE`` the bytes
forwarded per direction are written there as JSON on SIGTERM/SIGINT.

Used by bench_refit.py in front of a moto S3 server, so that dcr and the full-checkpoint reference
go through exactly the same link.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path

CHUNK = 256 << 10  # bytes read per socket call
BURST_S = 0.02  # a direction may run ahead of its average rate by this much link time


class Bucket:
    """A virtual-clock token bucket: bytes are released at ``rate`` on average, bursts of BURST_S."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.clock = time.monotonic()
        self.bytes = 0

    async def take(self, n: int) -> None:
        self.bytes += n
        if self.rate is None:
            return
        now = time.monotonic()
        self.clock = max(self.clock, now - BURST_S) + n / self.rate
        delay = self.clock - now - BURST_S
        if delay > 0:
            await asyncio.sleep(delay)


def parse_rate(text: str) -> float:
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    text = text.strip()
    if text[-1:].upper() in units:
        return float(text[:-1]) * units[text[-1].upper()]
    return float(text)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: Bucket, delay: float) -> None:
    """Forward one direction: each chunk enters the link at the bucket's rate and arrives ``delay``
    seconds later (the one-way latency of a link between regions), in order, without the latency
    limiting the rate (a delay line, as a long link is)."""
    line: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def deliver() -> None:
        while (entry := await line.get()) is not None:
            due, data = entry
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.ensure_future(deliver()) if delay > 0 else None
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            await bucket.take(len(data))
            if sender is None:
                writer.write(data)
                await writer.drain()
            else:
                line.put_nowait((time.monotonic() + delay, data))
        if sender is not None:
            line.put_nowait(None)
            await sender
    except (ConnectionError, asyncio.CancelledError):
        if sender is not None:
            sender.cancel()
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(target: tuple[str, int], rate: float | None, port: int, stats: Path | None, delay: float) -> None:
    up, down = Bucket(rate), Bucket(rate)

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*target, limit=CHUNK)
        except OSError:
            client_w.close()
            return
        with contextlib.suppress(asyncio.CancelledError):  # the proxy is shutting down
            await asyncio.gather(pump(client_r, server_w, up, delay), pump(server_r, client_w, down, delay))

    server = await asyncio.start_server(handle, "127.0.0.1", port, limit=CHUNK)
    print(server.sockets[0].getsockname()[1], flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    if stats is not None:
        stats.write_text(json.dumps({"up": up.bytes, "down": down.bytes}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--rate", default=None, help="bytes per second per direction, e.g. 12.5M (default: no limit)")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")
    ap.add_argument("--stats", type=Path, default=None, help="write bytes forwarded per direction here on exit")
    ap.add_argument("--delay", type=float, default=0.0, help="one-way latency in seconds, each direction (default 0)")
    args = ap.parse_args()
    host, _, port = args.target.rpartition(":")
    rate = parse_rate(args.rate) if args.rate else None
    asyncio.run(serve((host, int(port)), rate, args.port, args.stats, args.delay))


if __name__ == "__main__":
    main()
