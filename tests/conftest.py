import os

# Tests never reach the network and never need a GPU.
os.environ.setdefault("WANDB_MODE", "offline")
