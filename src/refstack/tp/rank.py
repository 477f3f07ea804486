"""One tensor-parallel rank: its shard of the model and cache, and the loop of ranks 1..N-1.

``RankShard`` is what every rank holds.  Rank 0 (in the server process, see
``refstack.tp.group``) drives its own through the engine; the others run
``rank_main``: wait for rank 0's next step, run the same forward on their shard
(the collectives inside pair up with rank 0's), repeat until told to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor

from infra_agent import tracing
from refstack.disagg.proc import die_with_parent
from refstack.engine.config import EngineConfig, resolve_dtype
from refstack.engine.tracing_start import start_tracing
from refstack.model.batch import SeqChunk
from refstack.model.cache import ModelCache
from refstack.model.config import HybridConfig
from refstack.model.model import HybridModel
from refstack.tp.comm import Comm, DistComm
from refstack.tp.shard import local_config, shard_model
from refstack.tp.step import OP_FORWARD, receive_step

log = logging.getLogger(__name__)


def model_config(config: EngineConfig) -> HybridConfig:
    """The whole model a launch serves (the single-process engine's overrides: same weights)."""
    overrides: dict[str, Any] = {"lm_head_precision": config.lm_head_precision, "seed": config.seed,
                                 "dtype": resolve_dtype(config.dtype, "torch")}
    if config.max_seq_len:
        overrides["max_seq_len"] = config.max_seq_len
    return HybridConfig.preset(config.preset).with_overrides(**overrides)


def threads_per_rank(config: EngineConfig, device: str) -> int:
    """torch threads of one rank: ``--torch-threads``, or (0) an equal share of the CPUs, so
    N ranks do not each start one thread per core and oversubscribe them."""
    if config.torch_threads or device != "cpu":
        return config.torch_threads
    return max(1, (os.cpu_count() or 1) // config.tp)


class RankShard:
    """This rank's slice of the model (built whole from the seed, then cut) and its cache."""

    def __init__(self, config: EngineConfig, comm: Comm, device: torch.device | str = "cpu") -> None:
        self.comm = comm
        self.config = model_config(config)
        self.model = shard_model(HybridModel(self.config), comm, config.tp_gemm_precision).to(device)
        self.local_config = local_config(self.config, comm.world)
        self.max_seq_len = config.max_seq_len or self.config.max_seq_len

    def new_cache(self, num_slots: int, max_seq_len: int | None = None) -> ModelCache:
        return ModelCache(self.local_config, num_slots, max_seq_len, device=self.model.device)

    def forward(self, chunks: Sequence[SeqChunk], cache: ModelCache,
                every: Collection[int]) -> tuple[Tensor, dict[int, Tensor]]:
        with tracing.span("tp.forward", cat="tp", rank=self.comm.rank, num_chunks=len(chunks)):
            if every:
                return self.model.forward_chunks_all_positions(chunks, cache, every)
            return self.model.forward_chunks(chunks, cache), {}


def _serve_traces(conn: Any, rank: int, lock: threading.Lock) -> None:
    """Answer rank 0's trace requests on the pipe (a thread: the main one sits in collectives)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "trace":
            tracer = tracing.get_tracer()
            snap = tracer.snapshot(process_name=f"refstack tp rank {rank} (pid {os.getpid()})")
            if msg[1]:
                tracer.reset()
            with lock:
                conn.send(("trace", snap, tracer.origin_perf_ns))


def rank_main(rank: int, config: EngineConfig, init_method: str, device: str, conn: Any) -> None:
    """A rank process's target: build the shard, join the group, mirror rank 0's steps."""
    die_with_parent()  # the server's death (any cause) ends the ranks: no orphans
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; rank 0 stops us
    start_tracing(config, child=f"rank{rank}")
    if threads_per_rank(config, device):
        torch.set_num_threads(threads_per_rank(config, device))
    threading.current_thread().name = f"tp-rank-{rank}"
    lock = threading.Lock()
    conn.send(("joining", os.getpid()))  # rank 0 joins the group only once every rank got this far
    comm = DistComm(rank, config.tp, init_method, device)
    shard = RankShard(config, comm, comm.device)
    cache = shard.new_cache(config.slots, shard.max_seq_len)
    threading.Thread(target=_serve_traces, args=(conn, rank, lock), name="tp-trace", daemon=True).start()
    with lock:
        conn.send(("ready", os.getpid()))
    try:
        while True:
            msg = receive_step(comm)
            if msg.op != OP_FORWARD:
                break
            shard.forward(msg.chunks, cache, msg.every)
    except Exception as exc:  # noqa: BLE001 -- rank 0 went away mid-collective: nothing left to serve
        print(f"refstack tp rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr, flush=True)
        os._exit(1)
    comm.close()
