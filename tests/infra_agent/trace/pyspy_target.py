"""A process for py-spy: MainThread holds the GIL in C (sum over a range) inside
ep.dispatch spans while a kv-transfer thread tries to run Python in transfer spans."""

import sys
import threading
import time

from infra_agent import tracing

tracing.enable()
stop = threading.Event()


def transfer() -> None:
    while not stop.is_set():
        with tracing.span("transfer", cat="kv_transfer"):
            x = 0
            for i in range(20000):  # Python bytecode: needs the GIL
                x += i
        time.sleep(0.001)


def main() -> None:
    print("ready", flush=True)
    sys.stdin.readline()  # wait until the sampler is attached
    th = threading.Thread(target=transfer, name="kv-transfer")
    th.start()
    for _ in range(8):
        with tracing.span("ep.dispatch", cat="ep"):
            sum(range(3_000_000))  # HOLDS_GIL: C loop, no GIL release
        time.sleep(0.01)
    stop.set()
    th.join()
    tracing.dump(sys.argv[1])


main()
