"""Hardware profiles of the projection (data/hardware.json, versioned): per GPU, the memory and FLOP rates the step
bench's ceilings measure and the link rates the comm term runs over, each with where it came from (measured here,
published, or a measured profile scaled by a published ratio: docs/projection.md)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources

from deepinfer.errors import DeepInferError

HARDWARE_FILE = "hardware.json"
FIELDS = ("memory_gib", "memory_bytes_per_s", "bf16_flops_per_s", "fp8_flops_per_s", "nvlink_bytes_per_s",
          "nvlink_domain", "scaleout_bytes_per_s", "compute_source", "link_source")


@dataclass(frozen=True)
class Profile:
    name: str
    memory_gib: float
    memory_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    nvlink_bytes_per_s: float      # one direction, per GPU
    nvlink_domain: int             # GPUs one NVLink domain holds (a node; 72 on NVL72)
    scaleout_bytes_per_s: float    # one direction, per GPU, between domains (RDMA)
    compute_source: str
    link_source: str
    version: int

    def link(self, ep: int) -> str:
        """The link an EP group of `ep` ranks exchanges over: NVLink inside one domain, else RDMA."""
        return "nvlink" if ep <= self.nvlink_domain else "rdma"

    def scaled(self, measured: "Profile") -> dict[str, float]:
        """This profile's rates over `measured`'s (what a compute term measured on `measured` is scaled by)."""
        return {k: getattr(self, k) / getattr(measured, k)
                for k in ("memory_bytes_per_s", "bf16_flops_per_s", "fp8_flops_per_s")}


def profiles(path=None) -> dict[str, Profile]:
    """Every profile by name, from the packaged file or `path`."""
    text = (resources.files(__package__) / "data" / HARDWARE_FILE).read_text() if path is None else open(path).read()
    data = json.loads(text)
    out = {}
    for name, p in data["profiles"].items():
        missing = [f for f in FIELDS if f not in p]
        if missing:
            raise DeepInferError(f"{HARDWARE_FILE}: profile {name} lacks {missing}")
        out[name] = Profile(name, *(p[f] for f in FIELDS), version=data["version"])
    return out


def profile(name: str, path=None) -> Profile:
    """One profile by name (case-insensitive); one line naming the known ones when it is not there."""
    known = profiles(path)
    for k, p in known.items():
        if k.lower() == name.lower():
            return p
    raise DeepInferError(f"no hardware profile {name!r}: use one of {sorted(known)} (harness/projection/data/"
                         f"{HARDWARE_FILE})")


def match(device_name: str, path=None) -> Profile | None:
    """The profile of a GPU as torch names it ('NVIDIA H200', 'NVIDIA H100 80GB HBM3'), or None."""
    words = re.split(r"[^A-Z0-9]+", device_name.upper())
    for k, p in profiles(path).items():
        if k.upper() in words:
            return p
    return None
