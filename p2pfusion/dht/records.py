"""What a peer announces in the DHT, and how records are keyed.

Every peer of a model writes one subkey under the model's key. The subkey carries the peer's
RSA public key (hivemind's `[owner:...]` marker), so the DHT's signature validator rejects any
write to it not signed by that key: no peer can overwrite another's record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class PeerState(str, Enum):
    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"


@dataclass(frozen=True)
class PeerRecord:
    model: str
    peer_id: str
    maddrs: list[str]
    start: int
    end: int
    state: PeerState
    throughput: float
    device: str

    def to_value(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_value(cls, value: Any) -> "PeerRecord | None":
        """Parse a DHT value; None for anything malformed, since other peers' values are untrusted."""
        if not isinstance(value, dict):
            return None
        try:
            record = cls(
                model=str(value["model"]),
                peer_id=str(value["peer_id"]),
                maddrs=[str(m) for m in value["maddrs"]],
                start=int(value["start"]),
                end=int(value["end"]),
                state=PeerState(value["state"]),
                throughput=float(value["throughput"]),
                device=str(value["device"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return record if 0 <= record.start < record.end else None


def model_key(model: str) -> str:
    return f"p2pfusion.model.{model}"
