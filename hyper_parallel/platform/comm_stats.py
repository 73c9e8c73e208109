"""Counters of the collectives that actually went on the wire.

[Note: what is counted]
Each platform records at the point where it calls the framework's collective, so a
collective the device lacks and the platform composes (MindSpore CPU builds a
reduce-scatter from an all-reduce) is recorded as what it really was: ``op`` is what the
caller asked for, ``wire`` what the framework executed, ``nbytes`` the size of the buffer
that crossed the wire (all-gather: the gathered output; reduce-scatter: the input;
all-reduce and broadcast: the tensor). ``dim`` names the mesh dimension ("shard",
"post_forward" (the smaller group of ``reshard_after_forward=k``), "replicate", or ""
when not called through a mesh).

The counters live on the platform instance (one per process), never on a class;
``hp.comm_stats()`` and ``hp.track_comms()`` read them (hyper_parallel/comm_stats.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommRecord:
    """Calls and bytes for one (op, wire, dim) key."""

    calls: int = 0
    nbytes: int = 0


@dataclass
class CommStats:
    """Live counters of one process; ``snapshot()`` copies them, ``delta`` subtracts."""

    records: dict = field(default_factory=dict)

    def record(self, op: str, wire: str, nbytes: int, dim: str = "") -> None:
        entry = self.records.setdefault((op, wire, dim), CommRecord())
        entry.calls += 1
        entry.nbytes += int(nbytes)

    def reset(self) -> None:
        self.records.clear()

    def snapshot(self) -> "CommStats":
        return CommStats({k: CommRecord(v.calls, v.nbytes) for k, v in self.records.items()})

    def minus(self, earlier: "CommStats") -> "CommStats":
        out = {}
        for key, rec in self.records.items():
            old = earlier.records.get(key, CommRecord())
            if rec.calls - old.calls:
                out[key] = CommRecord(rec.calls - old.calls, rec.nbytes - old.nbytes)
        return CommStats(out)

    def calls(self, op: str | None = None, *, wire: str | None = None, dim: str | None = None) -> int:
        """Number of calls matching the given op / wire op / mesh dim (None matches all)."""
        return sum(r.calls for k, r in self._matching(op, wire, dim))

    def nbytes(self, op: str | None = None, *, wire: str | None = None, dim: str | None = None) -> int:
        """Bytes matching the given op / wire op / mesh dim (None matches all)."""
        return sum(r.nbytes for k, r in self._matching(op, wire, dim))

    def _matching(self, op, wire, dim):
        for key, rec in self.records.items():
            if op is not None and key[0] != op:
                continue
            if wire is not None and key[1] != wire:
                continue
            if dim is not None and key[2] != dim:
                continue
            yield key, rec

    def summary(self) -> dict:
        """``{op: {"calls", "bytes", "wire", "dims"}}``, the form users print."""
        out: dict = {}
        for (op, wire, dim), rec in sorted(self.records.items()):
            entry = out.setdefault(op, {"calls": 0, "bytes": 0, "wire": set(), "dims": set()})
            entry["calls"] += rec.calls
            entry["bytes"] += rec.nbytes
            entry["wire"].add(wire)
            if dim:
                entry["dims"].add(dim)
        for entry in out.values():
            entry["wire"] = sorted(entry["wire"])
            entry["dims"] = sorted(entry["dims"])
        return out

    def __repr__(self) -> str:
        return f"CommStats({self.summary()})"
