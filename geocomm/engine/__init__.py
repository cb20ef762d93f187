"""The engine: the staged compressed algorithm and what it stands on
(docs/design.md, "Architecture").

Modules, each importing only those above it in this list (tests/test_imports.py
checks that the import graph has no cycle):

* :mod:`~geocomm.engine.costs`: what a backend costs (stage size, ``auto``'s crossover);
* :mod:`~geocomm.engine.layout`: shards, pieces, the schedule, rounding streams;
* :mod:`~geocomm.engine.protocols`: the pipelines' phases, range maps, map plans;
* :mod:`~geocomm.engine.host`: the host-driven pipeline;
* :mod:`~geocomm.engine.device_tables`: the batched pipeline's tables, planned on the host;
* :mod:`~geocomm.engine.device`: the batched pipeline (kernels, stream-ordered waits);
* :mod:`~geocomm.engine.exact`: exact sums, IEEE fp32 add/subtract on every device;
* :mod:`~geocomm.engine.transforming`: how a collective drives a transforming codec.

Which pipeline a call runs is the collectives' choice (:mod:`geocomm.collectives`).
"""
