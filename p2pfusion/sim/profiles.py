"""What volunteers bring: devices, their links, and the models they serve, as figures.

Device figures are approximate peak dense FP16 tensor throughput (FP32 for the CPU and Apple's
GPU, which have no FP16 tensor units) and memory, from the makers' spec sheets (docs/simulator.md
cites them). A peer computes at `UTILIZATION` of that peak, and holds as many layers as fit in
`WEIGHTS_SHARE` of its memory. These are assumptions of the simulator, not measurements: what it
compares is placements of the same fleet, so a figure that is off by a factor changes every
placement's throughput alike.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
UTILIZATION = 0.3  # of peak FLOPs in a batched forward
WEIGHTS_SHARE = 0.8  # of device memory for weights; the rest is the KV cache and the runtime


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    tflops: float
    share: float  # of a fleet's volunteers


DEVICES = (
    Device("RTX 3060 12GB", 12, 51, 0.22),
    Device("RTX 3080 10GB", 10, 119, 0.18),
    Device("RTX 4090 24GB", 24, 165, 0.14),
    Device("A100 80GB", 80, 312, 0.04),
    Device("T4 16GB", 16, 65, 0.12),
    Device("Apple M2 Max 32GB", 24, 13.6, 0.12),  # unified memory: what the GPU may take of 32 GiB
    Device("CPU only, 64GB", 64, 1.5, 0.18),
)


# Not a volunteer: the datacenter server of FusionAI's projection (scripts/sim_projection.py),
# an H100 SXM (989 TFLOPS FP16 tensor, dense; 80 GB), four to a server joined by NVLink
H100 = Device("H100 SXM 80GB", 80, 989, 0.0)


@dataclass(frozen=True)
class Link:
    name: str
    mbit: float  # upload, what bounds a peer's outgoing hidden states
    share: float


LINKS = (Link("DSL", 20, 0.25), Link("cable", 100, 0.45), Link("fibre", 1000, 0.30))


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    params_per_layer: float
    bytes_per_param: float
    hidden: int

    def layer_bytes(self) -> float:
        return self.params_per_layer * self.bytes_per_param


# Llama 2/3 70B: 80 layers of about 0.86 B parameters, hidden size 8192
MODELS = {
    "llama-70b-int8": ModelShape("llama-70b-int8", 80, 0.856e9, 1.0, 8192),
    "llama-70b-int4": ModelShape("llama-70b-int4", 80, 0.856e9, 0.5, 8192),
}
HIDDEN_BYTES = 2  # a hidden state's element on the wire (float16)


def compute_rate(device: Device, model: ModelShape) -> float:
    """Tokens/s the device carries through one layer (PeerRecord.compute_rate)."""
    return UTILIZATION * device.tflops * 1e12 / (2 * model.params_per_layer)


def network_rate(link: Link | None, model: ModelShape) -> float | None:
    """Tokens/s of hidden states the link sends out (PeerRecord.network_rate); None for the
    links inside one server, which never bound it."""
    return None if link is None else link.mbit * 1e6 / 8 / (model.hidden * HIDDEN_BYTES)


def max_layers(device: Device, model: ModelShape) -> int:
    return int(WEIGHTS_SHARE * device.memory_gib * GIB // model.layer_bytes())
