"""Eager param server (EPS): the host owns the model; each part is updated as soon as its
gradients for the whole minibatch exist. L2L relays over it (strategies/l2l.py) and the
pipelines keep their host-resident masters in it (`strategy.offload=host`).

The model is split into *parts* in relay order: the embeddings, every block, the head; the
EPS keeps each part's fp32 masters, optimizer state and wire copies on the host and steps a
part on a background thread while the backward of the parts below it runs.

    parts.py   `Part`: a part's masters in one flat buffer, its wires; tied weights
    worker.py  the background thread that folds gradients in and steps parts; `EpsStats`
    peers.py   `Peers`: replicas, and the EPS state replicated or sharded over them
    table.py   the early update of an input embedding table, behind the backward
    server.py  `EagerParamServer`, `Shipment`: submit, wait, deferred (exact) steps
"""

from relaytrain.strategies.eps.parts import Part
from relaytrain.strategies.eps.peers import Peers
from relaytrain.strategies.eps.server import EagerParamServer, Shipment
from relaytrain.strategies.eps.worker import EpsStats

__all__ = ["EagerParamServer", "EpsStats", "Part", "Peers", "Shipment"]
