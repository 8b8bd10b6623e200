"""Data formats: what ``train.data.format`` names, and the registry that finds them.

A ``DataFormat`` turns a ``train.data`` source (a format, a location, options) into the batches of a
split (``Batches``: ``batch(step, reads)`` of the training split, ``ordered_batches(reads)`` of the
held-out one, each as a rank holds it: ``hetero.data.rank_batches``), holding the columns the graph's
kinds read. Built-in formats are the datasets hetero writes itself (``builtin.py``: ``digits``, ``genome``, ``photo_documents`` ...) and the formats of users' files,
which are ``SampleFormat``s (``samples.py``): samples by id with a cheap description, shaped into rows by
one collation step (``hetero.data.collate``): ``llava`` conversations (``llava.py``), ``webdataset``
image-caption shards (``image_text.py``) and ``text`` JSONL (``text_jsonl.py``).

Users' formats register like users' kinds: a ``DataFormat`` (class or instance) under the entry-point
group ``hetero.datasets`` of an installed package, e.g. in its ``pyproject.toml``::

    [project.entry-points."hetero.datasets"]
    signals = "signal_encoder.source:SignalFormat"
"""
