import os

# Tests never reach the network and never need a GPU.
os.environ.setdefault("WANDB_MODE", "offline")


# The slowest files first: pytest-xdist (--dist loadfile) hands out files in collection order, so a slow
# file collected last would run alone while the other worker sits idle.
SLOWEST_FIRST = ["test_graph_run.py", "test_checkpoint_resume.py", "test_gpt_parity.py", "test_faults.py",
                 "test_bench_graph.py", "test_graph_parity.py", "test_train_run.py", "test_entry_points.py"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order
