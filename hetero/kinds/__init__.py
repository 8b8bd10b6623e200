"""Models, written free of parallelism. ``MODEL_CONFIGS`` is the registry of module kinds: YAML can
name only these."""

from hetero.kinds.genezip.config import GeneZipConfig
from hetero.kinds.gpt.config import GPTConfig
from hetero.kinds.video.config import VideoConfig
from hetero.kinds.vit.config import ViTConfig

MODEL_CONFIGS: dict[str, type] = {
    "gpt": GPTConfig, "vit": ViTConfig, "video": VideoConfig, "genezip": GeneZipConfig,
}
