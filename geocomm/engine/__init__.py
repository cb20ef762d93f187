"""The engine: runs a call (docs/design.md, "Architecture").

Modules, each importing only those above it in this list (tests/test_imports.py
checks the order):

* :mod:`~geocomm.engine.costs`: what a backend costs (stage size, ``auto``'s crossover);
* :mod:`~geocomm.engine.layout`: shards, pieces, the schedule, rounding-stream mixing;
* :mod:`~geocomm.engine.protocols`: the pipelines' phases, range maps, map plans;
* :mod:`~geocomm.engine.call`: one call as the engine runs it (Signature, Call), its
  cross-rank fingerprint and call counts;
* :mod:`~geocomm.engine.host`: the host-driven pipeline;
* :mod:`~geocomm.engine.device_tables`: the device pipeline's tables, planned on the host;
* :mod:`~geocomm.engine.device`: the device pipeline (kernels, stream-ordered waits);
* :mod:`~geocomm.engine.exact`: exact sums, IEEE fp32 add/subtract on every device;
* :mod:`~geocomm.engine.transforming`: how a collective drives a transforming codec;
* :mod:`~geocomm.engine.hierarchical`: the node-local steps of node-aware collectives;
* :mod:`~geocomm.engine.checks`: the cross-rank check of a call;
* :mod:`~geocomm.engine.run`: :func:`~geocomm.engine.run.run`, which chooses how a
  call runs (exact, node-aware, device or host pipeline) and runs it.
"""
