"""Stop a window when its server is gone: connection refusals in a row.

A server that dies mid-window refuses every later connection at once, so without this
the load generator goes on "sending" every remaining request (19 207 of them once, for
seconds), each one a failure that says the same thing, and the result reads as a very
bad server rather than a dead one.  A few refusals can happen on a live server (a full
accept queue under a burst); a run of them with no success in between cannot.

Only the server's answer counts: a connection this machine could not open (out of file
descriptors under a burst, error kind ``client``) never reached the server, so it neither
adds to the streak nor breaks it; counted, it stopped windows on live servers.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra_agent.serving.client import RequestRecord

# Refusals in a row before the window stops: above what a burst against a full accept
# queue produces, small next to any window worth measuring.
DEFAULT_LIMIT = 16


@dataclass
class RefusalStreak:
    """Counts connection refusals since the last request that reached the server."""

    limit: int = DEFAULT_LIMIT
    streak: int = 0
    last_error: str = ""

    def see(self, rec: RequestRecord) -> bool:
        """Record one finished request; True when the streak has just reached the limit."""
        if rec.error_kind == "client":
            return False
        if rec.error_kind == "connect":
            self.streak += 1
            self.last_error = rec.error
            return self.streak == self.limit
        self.streak = 0
        return False

    @property
    def tripped(self) -> bool:
        return self.streak >= self.limit

    def reason(self) -> str:
        return (f"the server stopped accepting connections ({self.streak} refusals in a row, the last: "
                f"{self.last_error}); the window stopped sending")


__all__ = ["DEFAULT_LIMIT", "RefusalStreak"]
