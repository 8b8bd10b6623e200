"""The built-in module kinds: each a folder with its config and layout checks (``config.py``), the pure model
(``model.py``), its parallelize plan (``plan.py``) and what the runtime needs of it (``spec.py``).

``default_registry()`` holds the built-in kinds (``gpt``, ``vit``, ``projector``, ``genezip``, ``video``) and every kind
installed packages declare under the entry-point group ``hetero.kinds``; user code may register more.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from hetero.kinds.registry import ENTRY_POINT_GROUP, Kind, KindRegistry
from hetero.models.genezip.spec import GeneZipKind
from hetero.models.gpt.spec import GPTKind
from hetero.models.projector.spec import ProjectorKind
from hetero.models.video.spec import VideoKind
from hetero.models.vit.spec import ViTKind

BUILT_IN: tuple[Kind, ...] = (GPTKind(), ViTKind(), ProjectorKind(), GeneZipKind(), VideoKind())


def default_registry() -> KindRegistry:
    """A fresh registry of the built-in kinds and the installed packages' ``hetero.kinds`` entry points
    (each a ``Kind`` instance or class)."""
    registry = KindRegistry(BUILT_IN)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        registry.register(point.load())
    return registry
