"""A call's traffic counters: what one rank put on and took off the wire (``Comm.traffic``, the flight
recorder's entries, the records)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Traffic:
    """What one rank put on and took off the wire during one collective."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    phase_bytes: dict[str, int] = field(default_factory=dict)  # bytes sent inside each named phase
    partition_bytes: list[int] = field(default_factory=list)  # split algorithms: bytes sent to each owner

    def add(self, sent: int, received: int, messages: int) -> None:
        """Count a transfer (or another tally's totals) in this one. Mutates the counters."""
        self.bytes_sent += sent
        self.bytes_recv += received
        self.messages += messages
