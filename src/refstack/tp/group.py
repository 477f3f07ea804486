"""Rank 0 of a tensor-parallel group: the model the engine drives.

``TPModel`` has the model interface the engine uses (``config``, ``forward_chunks``,
``forward_chunks_all_positions``, ``new_cache``, ``device``), so the scheduler, sampler,
logprobs and server are the single-process ones.  Each forward first broadcasts the
step (``refstack.tp.step``) so ranks 1..N-1 run the same forward on their shards, then
runs rank 0's own; the collectives inside pair up across ranks.

Lifetime, as the disaggregated server's workers: the ranks are daemonic ``spawn``
children that get SIGTERM when this process dies (``PR_SET_PDEATHSIG``).  A watchdog
waits on their sentinels; one ending while serving records the failure, closes the
group so a forward blocked in a collective raises instead of waiting (the engine then
fails the requests in flight), and calls ``on_failure`` (the CLI shuts the server down
and exits 1).  ``close()`` stops them: a stop message, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import Tensor

from refstack.engine.config import EngineConfig
from refstack.model.batch import SeqChunk
from refstack.model.cache import ModelCache
from refstack.tp.checks import check_tp
from refstack.tp.comm import Comm, DistComm, LocalComm
from refstack.tp.rank import RankShard, rank_main, threads_per_rank
from refstack.tp.step import send_step, send_stop

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0


class RankFailure(RuntimeError):
    """A rank died: the step cannot run."""


class _Rank:
    def __init__(self, ctx: Any, rank: int, config: EngineConfig, init_method: str, device: str) -> None:
        self.rank = rank
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=rank_main, args=(rank, config, init_method, device, child),
                                name=f"refstack-tp-rank{rank}", daemon=True)
        self.proc.start()
        child.close()
        self.lock = threading.Lock()

    def expect(self, what: str, timeout: float) -> Any:
        """The rank's next message, which must be ``what``; raises if it dies or stalls first."""
        ready = multiprocessing.connection.wait([self.conn, self.proc.sentinel], timeout)
        if self.conn in ready:
            try:
                msg = self.conn.recv()
            except EOFError:
                msg = None
            if msg is not None and msg[0] == what:
                return msg
        if not ready:
            raise RankFailure(f"tensor-parallel rank {self.rank} did not start within {timeout:.0f} s")
        self.proc.join(1.0)
        raise RankFailure(f"tensor-parallel rank {self.rank} exited during startup (exit code {self.proc.exitcode})")


class TPModel:
    """The engine's model under ``--tp N``; see the module docstring."""

    def __init__(self, config: EngineConfig, on_failure: Callable[[str], None] | None = None,
                 device: str = "cpu") -> None:
        check_tp(config)
        if threads_per_rank(config, device):  # rank 0's share (the engine sets --torch-threads when given)
            torch.set_num_threads(threads_per_rank(config, device))
        self.world = config.tp
        self.on_failure = on_failure
        self.failure: str | None = None
        self._failure_lock = threading.Lock()
        self._stopping = False
        self.ranks: list[_Rank] = []
        self._dir = tempfile.mkdtemp(prefix="refstack-tp-") if self.world > 1 else ""
        comm: Comm
        try:
            if self.world > 1:
                init_method = f"file://{os.path.join(self._dir, 'rendezvous')}"
                ctx = multiprocessing.get_context("spawn")
                self.ranks = [_Rank(ctx, r, config, init_method, device) for r in range(1, self.world)]
                for rk in self.ranks:
                    rk.expect("joining", START_TIMEOUT_S)
                comm = DistComm(0, self.world, init_method, device)
            else:
                comm = LocalComm()
            self.comm = comm
            self.shard = RankShard(config, comm, getattr(comm, "device", device))
            for rk in self.ranks:
                rk.expect("ready", START_TIMEOUT_S)
        except BaseException:
            self._terminate()
            raise
        self.config = self.shard.config  # the whole model's: vocabulary, context, dtype
        self.backend = comm.backend
        self.gemm_precision = config.tp_gemm_precision
        self.native_kernels = False
        self._watchdog: threading.Thread | None = None
        if self.ranks:
            self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
            self._watchdog.start()

    # ---- the model interface the engine uses ------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.shard.model.device

    def to(self, device: Any) -> TPModel:
        assert torch.device(device).type == self.device.type, "TPModel is placed when built"
        return self

    def use_native_kernels(self, on: bool) -> None:
        if on:
            raise ValueError("the tensor-parallel shards run torch's kernels")

    def new_cache(self, num_slots: int, max_seq_len: int | None = None) -> ModelCache:
        """Rank 0's cache: its share of the KV heads and KDA heads (every rank holds its own)."""
        return self.shard.new_cache(num_slots, max_seq_len)

    def forward_chunks(self, chunks: Sequence[SeqChunk], cache: ModelCache) -> Tensor:
        return self._forward(chunks, cache, ())[0]

    def forward_chunks_all_positions(self, chunks: Sequence[SeqChunk], cache: ModelCache,
                                     every: Collection[int]) -> tuple[Tensor, dict[int, Tensor]]:
        return self._forward(chunks, cache, every)

    def _forward(self, chunks: Sequence[SeqChunk], cache: ModelCache,
                 every: Collection[int]) -> tuple[Tensor, dict[int, Tensor]]:
        if self.failure:
            raise RankFailure(self.failure)
        try:
            if self.ranks:
                send_step(self.comm, chunks, every)
            return self.shard.forward(chunks, cache, every)
        except RuntimeError as exc:  # a collective whose peer went away: say which
            if self._find_dead_rank():
                raise RankFailure(str(self.failure)) from exc
            raise

    # ---- lifetime ---------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return [os.getpid()] + [rk.proc.pid or 0 for rk in self.ranks]

    def worker_traces(self, reset: bool, timeout: float = 10.0) -> list[tuple[dict[str, Any], int]]:
        """Each other rank's trace snapshot and its span clock origin (perf_counter ns)."""
        out = []
        for rk in self.ranks:
            with rk.lock:
                try:
                    rk.conn.send(("trace", reset))
                    if rk.conn.poll(timeout):
                        msg = rk.conn.recv()
                        out.append((msg[1], msg[2]))
                except (OSError, EOFError):
                    continue
        return out

    def _find_dead_rank(self, timeout: float = 2.0) -> bool:
        """Record the first rank found dead as the failure (the engine thread's collective may
        raise before the watchdog wakes: both name the same rank)."""
        with self._failure_lock:
            if self.failure is None:
                ready = multiprocessing.connection.wait([rk.proc.sentinel for rk in self.ranks], timeout)
                dead = [rk for rk in self.ranks if rk.proc.sentinel in ready]
                if dead:
                    dead[0].proc.join(1.0)
                    self.failure = (f"tensor-parallel rank {dead[0].rank} died (exit code {dead[0].proc.exitcode}); "
                                    "shutting down")
            return self.failure is not None

    def _watch(self) -> None:
        multiprocessing.connection.wait([rk.proc.sentinel for rk in self.ranks])
        if self._stopping or not self._find_dead_rank():
            return
        log.error("refstack tp: %s", self.failure)
        # The survivors may sit in a collective with the dead rank; ending them makes rank 0's
        # side of it raise at once (gloo sees the connections close) instead of timing out.
        for other in self.ranks:
            if other.proc.is_alive():
                other.proc.kill()
        if self.on_failure is not None:
            self.on_failure(str(self.failure))

    def close(self) -> None:
        """Stop the ranks (after the engine thread has stopped: the stop is a collective)."""
        if self._stopping:
            return
        self._stopping = True
        if self.ranks and self.failure is None:
            try:
                send_stop(self.comm)
            except RuntimeError:
                pass
            for rk in self.ranks:
                rk.proc.join(STOP_TIMEOUT_S)
        self._terminate()

    def _terminate(self) -> None:
        self._stopping = True
        for rk in self.ranks:
            if rk.proc.is_alive():
                rk.proc.terminate()
        for rk in self.ranks:
            rk.proc.join(5.0)
            if rk.proc.is_alive():
                rk.proc.kill()
                rk.proc.join(2.0)
        comm = getattr(self, "comm", None)
        if comm is not None and self.failure is None:
            comm.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
