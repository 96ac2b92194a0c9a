"""A cluster as ``meshpipe plan`` sees it: nodes of GPUs, what one GPU computes and holds, and
what moving bytes costs inside a node (NVLink) and between nodes (the network).

Built-in descriptions (``CLUSTERS``) hold the vendors' dense bf16 peaks and memory sizes and
the bandwidths NCCL reaches on such nodes (below the links' nominal figures: a ring's bus
bandwidth on eight H100s over NVLink 4 is about 360 GB/s of its 450 GB/s a direction; a
400 Gb/s InfiniBand port per GPU gives about 45 GB/s). A TOML file describes one's own:

    [cluster]
    base = "h100"                # optional: start from a built-in description
    gpus_per_node = 8
    peak_tflops = 989            # dense bf16, per GPU
    memory_gib = 80
    hbm_tb_per_s = 3.35
    nvlink_gb_per_s = 360        # what one GPU moves a direction inside a node
    nvlink_latency_us = 8
    network_gb_per_s = 45        # per GPU, between nodes
    network_latency_us = 20
    reserved_gib = 6             # what the CUDA context, NCCL and fragmentation take
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from meshpipe.schedules.ranking import Link, TuneError

GIB = 2**30


class ClusterError(TuneError):
    """A cluster description that cannot be read: the message says what to change."""


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs; per GPU its dense bf16 peak (FLOP/s), memory and
    memory bandwidth (bytes, bytes/s), and the links a GPU reaches its node's GPUs by and
    other nodes' by. ``reserved_bytes`` of each GPU's memory never hold training state."""

    name: str
    gpus_per_node: int
    peak_flops: float
    memory_bytes: float
    hbm_bytes_per_s: float
    nvlink: Link
    network: Link
    reserved_bytes: float = 6 * GIB

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes


CLUSTERS: dict[str, Cluster] = {
    "h100": Cluster("h100", 8, 989e12, 80 * GIB, 3.35e12, Link(8e-6, 360e9), Link(20e-6, 45e9)),
    "h200": Cluster("h200", 8, 989e12, 141e9, 4.8e12, Link(8e-6, 360e9), Link(20e-6, 45e9)),
    "a100": Cluster("a100", 8, 312e12, 80 * GIB, 2.0e12, Link(10e-6, 240e9),
                    Link(20e-6, 22e9)),
}

# TOML key -> (Cluster field, the factor to its unit); each link takes two keys.
_SCALES = {"gpus_per_node": ("gpus_per_node", 1), "peak_tflops": ("peak_flops", 1e12),
           "memory_gib": ("memory_bytes", GIB), "hbm_tb_per_s": ("hbm_bytes_per_s", 1e12),
           "reserved_gib": ("reserved_bytes", GIB)}
_LINKS = ("nvlink", "network")
_KEYS = ("base", "name", *_SCALES, *(f"{link}_{part}" for link in _LINKS
                                      for part in ("gb_per_s", "latency_us")))


def cluster_named(name: str) -> Cluster:
    """A built-in description, or the one a TOML file at ``name`` holds."""
    if name.lower() in CLUSTERS:
        return CLUSTERS[name.lower()]
    if not name.endswith(".toml") and not Path(name).exists():
        raise ClusterError(f"unknown cluster {name!r}: give one of {', '.join(CLUSTERS)} or "
                           f"the path of a TOML file with a [cluster] table (docs/planning.md)")
    return cluster_from_toml(Path(name))


def cluster_from_toml(path: Path) -> Cluster:
    """The cluster of ``path``'s ``[cluster]`` table (see the module docstring)."""
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ClusterError(f"{path}: no such file; give --cluster h100, h200, a100 or a "
                           f"TOML file's path") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ClusterError(f"{path}: cannot read it as TOML: {error}") from None
    table = document.get("cluster")
    if not isinstance(table, dict):
        raise ClusterError(f"{path}: no [cluster] table; write the keys under [cluster]")
    return _cluster_of(table, path)


def _cluster_of(table: dict, path: Path) -> Cluster:
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise ClusterError(f"{path}: unknown key(s) {', '.join(unknown)} in [cluster]; the "
                           f"keys are {', '.join(_KEYS)}")
    base_name = table.get("base")
    if base_name is not None and base_name not in CLUSTERS:
        raise ClusterError(f"{path}: base = {base_name!r} is no built-in cluster; give one of "
                           f"{', '.join(CLUSTERS)}")
    base = CLUSTERS.get(base_name) if base_name else None
    missing = [key for key in _KEYS[2:] if key not in table and key != "reserved_gib"]
    if base is None and missing:
        raise ClusterError(f"{path}: [cluster] lacks {', '.join(missing)}; give them, or "
                           f"base = \"h100\" (or h200, a100) to start from a built-in one")
    changes: dict = {"name": str(table.get("name", path.stem))}
    for key, (field, scale) in _SCALES.items():
        if key in table:
            changes[field] = _positive(table[key], key, path) * scale
    for link in _LINKS:
        current = getattr(base, link) if base else Link(0.0, 1.0)
        bandwidth = table.get(f"{link}_gb_per_s")
        latency = table.get(f"{link}_latency_us")
        changes[link] = Link(
            current.latency if latency is None else _positive(latency, f"{link}_latency_us",
                                                              path, zero=True) * 1e-6,
            current.bytes_per_s if bandwidth is None else _positive(
                bandwidth, f"{link}_gb_per_s", path) * 1e9)
    if "gpus_per_node" in changes:
        if not isinstance(table["gpus_per_node"], int):
            raise ClusterError(f"{path}: gpus_per_node = {table['gpus_per_node']!r} must be a "
                               f"whole number of GPUs")
        changes["gpus_per_node"] = int(changes["gpus_per_node"])
    template = base or Cluster("", 1, 1.0, 1.0, 1.0, Link(0.0, 1.0), Link(0.0, 1.0))
    cluster = replace(template, **changes)
    if cluster.usable_bytes <= 0:
        raise ClusterError(f"{path}: reserved_gib ({cluster.reserved_bytes / GIB:g}) leaves "
                           f"no memory of memory_gib ({cluster.memory_bytes / GIB:g})")
    return cluster


def _positive(value: object, key: str, path: Path, *, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
            value == 0 and not zero):
        raise ClusterError(f"{path}: {key} = {value!r} must be a positive number")
    return float(value)


def describe(cluster: Cluster) -> str:
    """One line: the figures a plan was computed with."""
    return (f"{cluster.name}: nodes of {cluster.gpus_per_node}, {cluster.peak_flops / 1e12:g} "
            f"TFLOP/s bf16 and {cluster.memory_bytes / GIB:.0f} GiB per GPU, NVLink "
            f"{cluster.nvlink.bytes_per_s / 1e9:g} GB/s, network "
            f"{cluster.network.bytes_per_s / 1e9:g} GB/s per GPU")

