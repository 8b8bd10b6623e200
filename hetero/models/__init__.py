"""Models, written free of parallelism. ``MODEL_CONFIGS`` is the registry of module kinds: YAML can
name only these."""

from hetero.models.genezip import GeneZipConfig
from hetero.models.gpt import GPTConfig
from hetero.models.video import VideoConfig
from hetero.models.vision import ViTConfig

MODEL_CONFIGS: dict[str, type] = {
    "gpt": GPTConfig, "vit": ViTConfig, "video": VideoConfig, "genezip": GeneZipConfig,
}
