//! braid-balancer: cost model, per-module layout search, pipeline simulator and per-batch data-aware assignment.
