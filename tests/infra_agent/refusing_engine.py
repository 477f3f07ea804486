"""A stand-in serving engine that checks its arguments at start-up and refuses bad ones, as engines do.

    python refusing_engine.py --port N [--max-num-seqs N] [--max-num-batched-tokens N] [-- COMMAND ...]

- Flags are parsed by argparse: a value that is no int exits 2 with argparse's own
  ``usage:`` and ``error: argument --x: invalid int value`` lines.
- The parsed values go through a scheduler config that validates itself in a nested
  call: fewer batched tokens than sequences raises ``ValueError`` from two frames down,
  so the log holds INFO lines, then a real traceback, then a warning printed at exit
  (an engine's log rarely ends on its error line).
- Accepted arguments: ``COMMAND`` runs in this process's place (``exec``), so a
  workspace can put this in front of a real server; without one, a plain HTTP server
  answers on ``--port``.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import warnings
from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        self._verify()

    def _verify(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_num_seqs "
                             f"({self.max_num_seqs}): each step would not fit one token per sequence; raise "
                             "max_num_batched_tokens or lower max_num_seqs")


def _warn_at_exit() -> None:
    warnings.warn("stand-in engine: 1 shared memory segment was not released at shutdown", UserWarning, stacklevel=1)


def main(argv: list[str]) -> None:
    rest: list[str] = []
    if "--" in argv:
        argv, rest = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    parser = argparse.ArgumentParser(prog="refusing-engine serve")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="INFO %(asctime)s [engine] %(message)s", stream=sys.stdout)
    logging.info("stand-in engine starting on port %d", args.port)
    logging.info("non-default args: max_num_seqs=%d max_num_batched_tokens=%d", args.max_num_seqs,
                 args.max_num_batched_tokens)
    atexit.register(_warn_at_exit)
    SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens)
    atexit.unregister(_warn_at_exit)
    sys.stdout.flush()
    if rest:
        os.execv(rest[0], rest)
    os.execv(sys.executable, [sys.executable, "-m", "http.server", str(args.port), "--bind", "127.0.0.1"])


if __name__ == "__main__":
    main(sys.argv[1:])
