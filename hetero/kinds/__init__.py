"""The module-kind contract: ``registry.py`` (``Kind``, ``Port``, ``StageStep``, ``StageResult``,
``KindRegistry``), the batch columns kinds declare and their check (``columns.py``), the layout checks
kinds share (``layout_checks.py``) and FLOP counts (``flops.py``).

The built-in kinds live in ``hetero.models``; ``hetero.models.default_registry()`` gathers them with
every kind installed packages declare under the entry-point group ``hetero.kinds``. The entry points
(``hetero.cli``, the rank entry ``hetero.train.run``, benchmarks, tests) assemble it and pass it down:
nothing here, nor in graph, parallel, runtime, data, train or interop, imports ``hetero.models``
(``tests/test_import_floors.py``); a kind brings its FLOPs, routing statistics and Hugging Face mapping
through its ``Kind``.
"""
