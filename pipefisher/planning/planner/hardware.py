"""Hardware descriptions for the planner: one GPU model, its node and the links between GPUs, read
from a small YAML file or a shipped preset (`hardware_presets/*.yaml`, sources in each file and in
docs/planner.md). Pure Python: no torch.

A description (every field required unless a default is given):

    name: H100 SXM5 80GB                 # text
    source: NVIDIA H100 datasheet; ...   # where the numbers come from
    peak_tflops: {fp32: 67, bf16: 989.5} # dense peak TFLOP/s per dtype (fp32, tf32, bf16, fp16; at least one)
    memory_gib: 80                       # memory per GPU, GiB (2^30 bytes)
    memory_bandwidth_gbps: 3350          # its bandwidth, GB/s (10^9 bytes/s)
    gpus_per_node: 8
    intra_node_link: NVLink 4            # text
    intra_node_gbps: 450                 # per GPU and direction, GB/s
    inter_node_link: NDR InfiniBand      # text
    inter_node_gbps: 50                  # per GPU and direction, GB/s (400 Gb/s)
    intra_node_latency_us: 5             # optional, per ring step (DEFAULT_INTRA_LATENCY_US)
    inter_node_latency_us: 10            # optional, per ring step (DEFAULT_INTER_LATENCY_US)

`hardware_of("h100x8")` is the preset `h100` with 8 GPUs per node; `hardware_of("h100")` keeps the
preset's own count; any other text is read as a file. Bad input raises `HardwareError` (a
`PlanError`: one line naming the field and the fix).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipefisher.core.files import parse_yaml
from pipefisher.planning.planner.model_sizes import PlanError

PRESET_FOLDER = Path(__file__).resolve().parent / "hardware_presets"
DTYPES = ("fp32", "tf32", "bf16", "fp16")
#: latency per ring step (one message to the next GPU), µs: NVLink's and a same-node link's ~5 µs,
#: InfiniBand's ~10 µs (round figures of nccl-tests' small-message all-reduce times per step)
DEFAULT_INTRA_LATENCY_US = 5.0
DEFAULT_INTER_LATENCY_US = 10.0
_SPEC = re.compile(r"^([a-z0-9][a-z0-9-]*?)(?:x(\d+))?$")


class HardwareError(PlanError):
    """A hardware description that cannot be used (one line naming the field and the fix)."""


@dataclass(frozen=True)
class Link:
    """A link between GPUs: `kind` (text), `bandwidth_gbps` per GPU and direction (GB/s) and
    `latency_us` per ring step (µs)."""

    kind: str
    bandwidth_gbps: float
    latency_us: float = 0.0

    def ring_seconds(self, bytes_sent: float, steps: int) -> float:
        """Seconds for a ring collective in which each GPU sends `bytes_sent` bytes in `steps`
        messages: bytes at the bandwidth plus one latency per step."""
        return bytes_sent / (self.bandwidth_gbps * 1e9) + steps * self.latency_us * 1e-6


@dataclass(frozen=True)
class Hardware:
    """One GPU model in its node (module docstring for the fields and units)."""

    name: str
    source: str
    peak_tflops: tuple[tuple[str, float], ...]
    memory_gib: float
    memory_bandwidth_gbps: float
    gpus_per_node: int
    intra_node_link: str
    intra_node_gbps: float
    inter_node_link: str
    inter_node_gbps: float
    intra_node_latency_us: float = DEFAULT_INTRA_LATENCY_US
    inter_node_latency_us: float = DEFAULT_INTER_LATENCY_US

    @property
    def intra(self) -> Link:
        return Link(self.intra_node_link, self.intra_node_gbps, self.intra_node_latency_us)

    @property
    def inter(self) -> Link:
        return Link(self.inter_node_link, self.inter_node_gbps, self.inter_node_latency_us)

    def link_between(self, processes: tuple[int, ...]) -> Link:
        """The slowest link a group of processes (global GPU indices, `gpus_per_node` consecutive
        ones per node) crosses: inter-node where they sit on more than one node."""
        nodes = {process // self.gpus_per_node for process in processes}
        return self.inter if len(nodes) > 1 else self.intra

    def tensor_parallel_link(self, tensor_parallel: int) -> Link:
        """The link a rank's tensor-parallel all-reduces cross: its T consecutive GPUs
        (`pipefisher.core.topology`) share a node when T divides the GPUs per node."""
        return self.intra if self.gpus_per_node % tensor_parallel == 0 else self.inter

    def peak(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s in `dtype` (None: the GPU has no such unit)."""
        return dict(self.peak_tflops).get(dtype)

    def describe(self) -> str:
        """One line: e.g. ``H100 SXM5 80GB, 8 per node on NVLink 4 (450 GB/s), NDR InfiniBand (50 GB/s)``."""
        return (
            f"{self.name}, {self.gpus_per_node} per node on {self.intra_node_link} ({self.intra_node_gbps:g} GB/s, "
            f"{self.intra_node_latency_us:g} us), nodes on {self.inter_node_link} ({self.inter_node_gbps:g} GB/s per GPU, "
            f"{self.inter_node_latency_us:g} us)"
        )


def presets() -> list[str]:
    """Names of the shipped presets."""
    return sorted(path.stem for path in PRESET_FOLDER.glob("*.yaml"))


def hardware_of(spec: str) -> Hardware:
    """A preset (`NAME` or `NAMExG`: G GPUs per node) or a YAML file (module docstring)."""
    found = _SPEC.match(spec.lower())
    if found and (PRESET_FOLDER / f"{found.group(1)}.yaml").is_file():
        hardware = load_hardware(PRESET_FOLDER / f"{found.group(1)}.yaml")
        if found.group(2) is None:
            return hardware
        per_node = int(found.group(2))
        if per_node < 1:
            raise HardwareError(f"--hardware {spec}: GPUs per node must be at least 1 (e.g. {found.group(1)}x8)")
        return replace(hardware, gpus_per_node=per_node)
    path = Path(spec)
    if not path.is_file():
        raise HardwareError(
            f"--hardware {spec}: neither a preset ({', '.join(presets())}, optionally xG for G GPUs per node) nor a file"
        )
    return load_hardware(path)


def load_hardware(path: str | Path) -> Hardware:
    """The description in the YAML file `path` (HardwareError naming the bad field)."""
    try:
        data = parse_yaml(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HardwareError(f"{path}: cannot read it as YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise HardwareError(f"{path}: expected a mapping of fields (name: ..., memory_gib: ...)")
    return hardware_from_dict(data, str(path))


def _number(data: dict[str, Any], key: str, where: str, whole: bool = False) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        kind = "a whole number" if whole else "a number"
        raise HardwareError(f"{where}: {key}: {value!r} must be {kind} > 0")
    if whole and int(value) != value:
        raise HardwareError(f"{where}: {key}: {value!r} must be a whole number > 0")
    return value


def hardware_from_dict(data: dict[str, Any], where: str = "hardware") -> Hardware:
    """The description in `data` (a parsed YAML mapping); `where` names it in errors."""
    fields = Hardware.__dataclass_fields__
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise HardwareError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(fields)}")
    optional = {"intra_node_latency_us", "inter_node_latency_us"}
    missing = [key for key in fields if key not in data and key not in optional]
    if missing:
        raise HardwareError(f"{where}: {missing[0]} missing; add it (docs/planner.md, hardware descriptions)")
    for key in ("name", "source", "intra_node_link", "inter_node_link"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise HardwareError(f"{where}: {key}: {data[key]!r} must be non-empty text")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks:
        raise HardwareError(f"{where}: peak_tflops: {peaks!r} must map dtypes ({', '.join(DTYPES)}) to TFLOP/s")
    for dtype in peaks:
        if dtype not in DTYPES:
            raise HardwareError(f"{where}: peak_tflops: unknown dtype {dtype!r}; use {', '.join(DTYPES)}")
        _number(peaks, dtype, f"{where}: peak_tflops")
    numbers = {
        key: _number(data, key, where, whole=key == "gpus_per_node")
        for key in ("memory_gib", "memory_bandwidth_gbps", "gpus_per_node", "intra_node_gbps", "inter_node_gbps")
    }
    latencies = {key: _number(data, key, where) for key in optional if key in data}
    return Hardware(
        name=data["name"],
        source=data["source"],
        peak_tflops=tuple((dtype, float(peaks[dtype])) for dtype in DTYPES if dtype in peaks),
        memory_gib=float(numbers["memory_gib"]),
        memory_bandwidth_gbps=float(numbers["memory_bandwidth_gbps"]),
        gpus_per_node=int(numbers["gpus_per_node"]),
        intra_node_link=data["intra_node_link"],
        intra_node_gbps=float(numbers["intra_node_gbps"]),
        inter_node_link=data["inter_node_link"],
        inter_node_gbps=float(numbers["inter_node_gbps"]),
        **{key: float(value) for key, value in latencies.items()},
    )
