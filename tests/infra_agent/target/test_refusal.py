"""The engine's own error line: found in log tails written the way engines write them, and carried
by ``ServerExitedEarly`` when a real process refuses its arguments at start-up."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from infra_agent.errors import ServerExitedEarly, ServerStartError
from infra_agent.target import ServerProcess
from infra_agent.target.launch_count import launches
from infra_agent.target.refusal import MAX_REASON, engine_reason
from infra_agent.workspace import ServerTargetSpec

ENGINE = Path(__file__).resolve().parents[1] / "refusing_engine.py"


def tail(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


# ---------------------------------------------------------------- log tails


def test_the_exception_ending_a_prefixed_traceback_not_the_warnings_after_it() -> None:
    log = tail("""
        (ApiServer pid=4410) INFO 03-14 09:12:01 [arg_utils.py:1101] resolved architecture: LlamaForCausalLM
        (ApiServer pid=4410) WARNING 03-14 09:12:01 [config.py:870] chunked prefill is on; max_num_batched_tokens=20
        (ApiServer pid=4410) Traceback (most recent call last):
        (ApiServer pid=4410)   File "/srv/env/bin/engine", line 8, in <module>
        (ApiServer pid=4410)     sys.exit(main())
        (ApiServer pid=4410)              ^^^^^^
        (ApiServer pid=4410)   File "/srv/env/lib/python3.12/site-packages/engine/config/scheduler.py", line 214, in verify
        (ApiServer pid=4410)     raise ValueError(
        (ApiServer pid=4410) ValueError: max_num_batched_tokens (20) is smaller than max_num_seqs (256). Raise it.
        /usr/lib/python3.12/multiprocessing/resource_tracker.py:254: UserWarning: 2 leaked semaphore objects to clean up
          warnings.warn('resource_tracker: There appear to be %d '
        INFO 03-14 09:12:02 [launcher.py:80] shutting down
    """)
    assert engine_reason(log) == "ValueError: max_num_batched_tokens (20) is smaller than max_num_seqs (256). Raise it."


def test_a_validation_error_keeps_its_error_lines_without_pydantic_noise() -> None:
    log = tail("""
        Traceback (most recent call last):
          File "/srv/engine/args.py", line 602, in build_scheduler
            return SchedulerConfig(**kwargs)
                   ^^^^^^^^^^^^^^^^^^^^^^^^^
        pydantic_core._pydantic_core.ValidationError: 2 validation errors for SchedulerConfig
        max_num_seqs
          Input should be greater than 0 [type=greater_than, input_value=0, input_type=int]
            For further information visit https://errors.pydantic.dev/2.11/v/greater_than
          Value error, max_num_batched_tokens (212) is smaller than max_num_seqs (256) [type=value_error, input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]
            For further information visit https://errors.pydantic.dev/2.11/v/value_error
    """)
    assert engine_reason(log) == (
        "pydantic_core._pydantic_core.ValidationError: 2 validation errors for SchedulerConfig: max_num_seqs: "
        "Input should be greater than 0: Value error, max_num_batched_tokens (212) is smaller than max_num_seqs (256)")


def test_a_chained_error_that_points_above_gives_way_to_the_root_cause() -> None:
    log = tail("""
        (EngineCore_0 pid=77) Traceback (most recent call last):
        (EngineCore_0 pid=77)   File "/srv/engine/core.py", line 410, in run_engine_core
        (EngineCore_0 pid=77)     raise RuntimeError("KV cache needs 9.1 GiB, 6.0 GiB free; lower max_model_len")
        (EngineCore_0 pid=77) RuntimeError: KV cache needs 9.1 GiB, 6.0 GiB free; lower max_model_len
        (ApiServer pid=76) Traceback (most recent call last):
        (ApiServer pid=76)   File "/srv/engine/client.py", line 88, in wait_for_engine
        (ApiServer pid=76)     raise RuntimeError(
        (ApiServer pid=76) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
    """)
    assert engine_reason(log) == "RuntimeError: KV cache needs 9.1 GiB, 6.0 GiB free; lower max_model_len"


def test_a_bare_assertion_names_the_line_that_failed() -> None:
    log = tail("""
        [2025-06-02 10:00:01 TP0] server args: chunked_prefill_size=100, page_size=64
        [2025-06-02 10:00:01 TP0] Traceback (most recent call last):
        [2025-06-02 10:00:01 TP0]   File "/srv/serve/server_args.py", line 388, in check
        [2025-06-02 10:00:01 TP0]     assert self.chunked_prefill_size % self.page_size == 0
        [2025-06-02 10:00:01 TP0]            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
        [2025-06-02 10:00:01 TP0] AssertionError
    """)
    assert engine_reason(log) == (
        "AssertionError at server_args.py:388: assert self.chunked_prefill_size % self.page_size == 0")


def test_a_tail_cut_inside_the_traceback_still_ends_on_its_exception() -> None:
    log = tail("""
        [rank0]:   File "/srv/engine/worker.py", line 51, in init_device
        [rank0]:     torch.cuda.set_device(self.device)
        [rank0]: torch.AcceleratorError: CUDA error: invalid device ordinal
        [rank0]:[W ProcessGroupNCCL.cpp:1479] Warning: destroy_process_group() was not called before exit
    """)
    assert engine_reason(log) == "torch.AcceleratorError: CUDA error: invalid device ordinal"


def test_a_parsers_refusal() -> None:
    argparse_log = tail("""
        usage: engine serve [-h] [--max-num-seqs MAX_NUM_SEQS] [--port PORT]
        engine serve: error: argument --max-num-seqs: invalid int value: 'lots'
    """)
    assert engine_reason(argparse_log) == "engine serve: error: argument --max-num-seqs: invalid int value: 'lots'"
    click_log = tail("""
        Usage: engine serve [OPTIONS]
        Try 'engine serve --help' for help.

        Error: Invalid value for '--max-running': 'x' is not a valid integer.
    """)
    assert engine_reason(click_log) == "Error: Invalid value for '--max-running': 'x' is not a valid integer."


def test_without_a_traceback_the_last_error_record() -> None:
    log = tail("""
        INFO 03-14 09:12:01 [server.py:40] loading weights
        ERROR 03-14 09:12:05 [worker.py:301] tensor_parallel_size 3 does not divide 32 attention heads
        ERROR 03-14 09:12:05 [server.py:95] engine failed to start: tensor_parallel_size 3 does not divide 32 heads
        WARNING 03-14 09:12:05 [server.py:99] exiting
    """)
    assert engine_reason(log) == "ERROR 03-14 09:12:05 [server.py:95] engine failed to start: tensor_parallel_size 3 " \
                                 "does not divide 32 heads"


def test_noise_alone_names_no_reason() -> None:
    log = tail("""
        INFO 03-14 09:12:01 [server.py:40] loading weights
        WARNING 03-14 09:12:02 [server.py:41] the tokenizer has no chat template
        /srv/engine/utils.py:12: DeprecationWarning: the 'device' argument is deprecated
          warnings.warn(
        Traceback (most recent call last):
    """)
    assert engine_reason(log) is None
    assert engine_reason("") is None


def test_a_long_message_is_cut_to_one_line() -> None:
    reason = engine_reason("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                           f"ValueError: {'too big ' * 200}")
    assert reason is not None and reason.startswith("ValueError: too big") and reason.endswith("…")
    assert len(reason) == MAX_REASON and "\n" not in reason


def test_the_message_quotes_the_reason_or_says_it_exited() -> None:
    refused = ServerExitedEarly("server", 1, "tail", "/logs/s.log", "ValueError: too few tokens")
    assert str(refused).startswith("server refused its configuration: ValueError: too few tokens (exit code 1)")
    assert refused.refused and refused.reason == "ValueError: too few tokens"
    silent = ServerExitedEarly("server", 3, "", None, None)
    assert str(silent) == "server exited before it was ready (exit code 3)" and silent.refused
    killed = ServerExitedEarly("server", -9, "", None, None)
    assert "killed by signal 9" in str(killed) and not killed.refused


# ---------------------------------------------------------------- a real process that refuses


def _spec(*flags: str, **kw: object) -> ServerTargetSpec:
    fields: dict[str, object] = {"kind": "server", "command": [sys.executable, str(ENGINE), "--port", "{port}", *flags],
                                 "ready_url": "/", "ready_timeout_s": 30}
    fields.update(kw)
    return ServerTargetSpec.model_validate(fields)


def test_a_refusing_engine_raises_with_its_error_line(tmp_path: Path, reap: list[int]) -> None:
    server = ServerProcess(_spec("--max-num-seqs", "{seqs}", "--max-num-batched-tokens", "{tokens}"),
                           {"seqs": 256, "tokens": 20}, tmp_path, root=tmp_path, name="engine")
    before = launches()
    with pytest.raises(ServerExitedEarly) as info:
        server.start()
    assert server.pgid is not None
    reap.append(server.pgid)
    err = info.value
    assert launches() == before + 1
    assert err.exit_code == 1 and err.refused
    assert err.reason is not None and err.reason.startswith(
        "ValueError: max_num_batched_tokens (20) is smaller than max_num_seqs (256)")
    assert str(err).startswith(f"engine refused its configuration: {err.reason} (exit code 1)")
    assert "Traceback" in err.log_tail and "UserWarning" in err.log_tail  # the noise the reason was found in


def test_an_argument_the_parser_refuses(tmp_path: Path, reap: list[int]) -> None:
    server = ServerProcess(_spec("--max-num-seqs", "{seqs}"), {"seqs": "many"}, tmp_path, root=tmp_path)
    with pytest.raises(ServerExitedEarly) as info:
        server.start()
    assert server.pgid is not None
    reap.append(server.pgid)
    assert info.value.exit_code == 2
    assert info.value.reason == "refusing-engine serve: error: argument --max-num-seqs: invalid int value: 'many'"


def test_accepted_arguments_serve(tmp_path: Path, reap: list[int]) -> None:
    # The same engine with values it accepts: the refusal above was the configuration's.
    with ServerProcess(_spec("--max-num-seqs", "8", "--max-num-batched-tokens", "64"), {}, tmp_path,
                       root=tmp_path) as server:
        assert server.pid is not None
        reap.append(server.pid)
        assert httpx.get(server.url + "/", trust_env=False).status_code == 200


def test_a_server_that_never_becomes_ready_is_no_refusal(tmp_path: Path, reap: list[int]) -> None:
    hang = [sys.executable, "-c", "import time; print('warming up', flush=True); time.sleep(1000)", "{port}"]
    server = ServerProcess(_spec(command=hang, ready_timeout_s=1.0), {}, tmp_path, root=tmp_path)
    with pytest.raises(ServerStartError) as info:
        server.start()
    assert server.pgid is not None
    reap.append(server.pgid)
    assert not isinstance(info.value, ServerExitedEarly) and info.value.reason is None
    assert "not ready after 1s" in str(info.value)
