"""What moving bytes costs: over the host<->device link, between neighbouring workers, and in the
collectives among workers (a ring all-reduce, PipeDream-2BW §4.2.1's bwth_width(w); an
all-to-all), at the rates and latency a profile gives (`relaytrain.cost.profile`). Every
strategy's cost model prices its transfers and collectives with these."""

from __future__ import annotations

from relaytrain.cost.profile import Profile


def upload_s(nbytes: float, profile: Profile) -> float:
    """Seconds to move `nbytes` between host and device (0 where the device is the host)."""
    rate = profile.host_to_device_bytes_per_s
    return nbytes / rate if rate else 0.0


def p2p_s(nbytes: float, workers: int, profile: Profile) -> float:
    """One message between neighbouring workers (another node's once the run spans nodes)."""
    spans_nodes = workers > profile.devices_per_node
    bw = profile.inter_node_bytes_per_s if spans_nodes else profile.stage_link_bytes_per_s
    return nbytes / bw + profile.link_latency_s


def allreduce_bandwidth(replicas: int, profile: Profile) -> float:
    """bwth_width(w) of §4.2.1: the node's links while the replicas fit in one node."""
    return profile.allreduce_bytes_per_s if replicas <= profile.devices_per_node else profile.inter_node_bytes_per_s


def allreduce_s(nbytes: float, replicas: int, profile: Profile, messages: int = 1, span: int | None = None) -> float:
    """A ring all-reduce of `nbytes` over `replicas` in `messages` pieces: 2 (w - 1) / w of the
    bytes cross each link, 2 (w - 1) hops of latency per piece. `span`: the consecutive workers
    the replicas are spread over (a replica of T tensor ranks: every T-th), whose node links
    carry it while they fit in one node (None: the replicas themselves)."""
    if replicas == 1:
        return 0.0
    bw = allreduce_bandwidth(span or replicas, profile)
    return 2 * (replicas - 1) / replicas * nbytes / bw + 2 * (replicas - 1) * profile.link_latency_s * messages


def all_to_all_s(nbytes: float, workers: int, profile: Profile, messages: int = 1) -> float:
    """An all-to-all of `nbytes` a worker among `workers` in `messages` calls: (w - 1) / w of them
    leave it (the rest is its own share) at the collectives' bandwidth, w - 1 hops of latency
    per call."""
    if workers == 1:
        return 0.0
    bw = allreduce_bandwidth(workers, profile)
    return (workers - 1) / workers * nbytes / bw + (workers - 1) * profile.link_latency_s * messages
