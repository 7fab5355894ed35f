"""Cost of one logged transition: the `transitions` dispatch of a declared move, plus rendering its event as a
JSON line to a file.

    python -m bench.lifecycle_cost [--n 20000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from scheduler.events import EventLog, JsonlSink
from scheduler.lifecycle import Lifecycle, Trigger
from scheduler.request import Request, SamplingParams


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lifecycle_cost", description=__doc__)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args(argv)
    lifecycle = Lifecycle()
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(args.n)]
    t0 = time.perf_counter()
    for r in requests:
        lifecycle.attach(r)
    t1 = time.perf_counter()
    for r in requests:
        lifecycle.fire(r, Trigger.START_PREFILL)
    t2 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        log = EventLog([JsonlSink(os.path.join(d, "events.jsonl"))])
        t3 = time.perf_counter()
        for i, r in enumerate(requests):
            log.emit("transition", i, request_id=r.request_id, trigger="start_prefill", reason=None,
                     **{"from": "queued", "to": "chunk_prefilling"})
        t4 = time.perf_counter()
        log.close()
    attach, fire, event = (t1 - t0) / args.n, (t2 - t1) / args.n, (t4 - t3) / args.n
    print(f"attach a request: {attach * 1e6:.2f} us; fire a declared transition: {fire * 1e6:.2f} us; "
          f"render its event to JSONL: {event * 1e6:.2f} us; one logged transition: {(fire + event) * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
