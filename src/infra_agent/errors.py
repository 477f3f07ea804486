"""The project's exception tree.

User mistakes (bad YAML, an unknown knob, an unreachable server) raise a subclass of
``InfraAgentError`` whose message a person can act on: it names the file, the field
path, what was expected and what was found.  The CLI prints that message and exits
with status 2, without a traceback.  Internal invariants are plain ``assert``s.
"""

from __future__ import annotations


class InfraAgentError(Exception):
    """Base of every error the CLI reports as a clean one-line (or few-line) message."""


class ConfigError(InfraAgentError):
    """A workspace or spec file is malformed, or a value is outside its domain."""

    def __init__(self, file: str | None, field: str | None, expected: str, got: object) -> None:
        self.file = file
        self.field = field
        self.expected = expected
        self.got = got
        where = file or "<config>"
        if field:
            where = f"{where}: {field}"
        super().__init__(f"{where}: expected {expected}, got {got!r}")


class TargetError(InfraAgentError):
    """The system under test cannot be reached, started, or spoke an unexpected protocol."""


class ServerStartError(TargetError):
    """A server exited early or never became ready; carries the exit code, the log tail and,
    when its log names one, the engine's own error line (``reason``)."""

    def __init__(self, message: str, exit_code: int | None, log_tail: str, log_path: str | None = None,
                 reason: str | None = None) -> None:
        self.exit_code = exit_code
        self.log_tail = log_tail
        self.log_path = log_path
        self.reason = reason
        detail = f"{message} (exit code {exit_code})" if exit_code is not None else message
        if log_path:
            detail += f"\nlog: {log_path}"
        if log_tail:
            detail += "\n--- log tail ---\n" + log_tail.rstrip()
        super().__init__(detail)


class ServerExitedEarly(ServerStartError):
    """The server exited before it was ready: it refused its configuration.

    Apart from a server that never became ready (a hang, a slow start, a wrong
    ``ready_url``): an engine that rejects its arguments exits at start-up, and the same
    arguments are rejected again on every launch, so the loop records the configuration
    as refuted instead of retrying it.  ``reason`` is the engine's error line from its log
    (``target/refusal.py``), None when the log names none.
    """

    def __init__(self, name: str, exit_code: int, log_tail: str, log_path: str | None, reason: str | None) -> None:
        self.name = name
        if exit_code < 0:
            message = f"{name} was killed by signal {-exit_code} before it was ready"
        elif reason:
            message = f"{name} refused its configuration: {reason}"
        else:
            message = f"{name} exited before it was ready"
        super().__init__(message, exit_code, log_tail, log_path, reason)

    @property
    def refused(self) -> bool:
        """It exited on its own (a status, not a signal): a kill by the OOM killer or a person
        says nothing about the configuration."""
        return self.exit_code is not None and self.exit_code > 0


class BenchmarkError(InfraAgentError):
    """A benchmark could not produce a trustworthy result."""


class KernelSpecError(InfraAgentError):
    """A kernel spec failed to import or is incomplete; names the spec and variant."""
