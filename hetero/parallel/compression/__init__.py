"""Communication compression for the gradient sync and the optimizer step (DESIGN §5).

``build.py`` turns a module's ``compression:`` YAML block into a gradient sync or a DiLoCo outer loop;
``codecs.py`` holds the compressors, ``collective.py`` the byte-counted collectives they run over.
"""
