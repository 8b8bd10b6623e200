"""The module-kind contract: ``registry.py`` (``Kind``, ``Port``, ``StageStep``, ``StageResult``,
``KindRegistry``), the batch columns kinds declare and their check (``columns.py``), the layout checks
kinds share (``layout_checks.py``) and FLOP counts (``flops.py``).

The built-in kinds live in ``hetero.models``; ``hetero.models.default_registry()`` gathers them with
every kind installed packages declare under the entry-point group ``hetero.kinds``.
"""
