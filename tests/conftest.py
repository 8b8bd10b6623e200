import os

# Tests never reach the network and never need a GPU.
os.environ.setdefault("WANDB_MODE", "offline")


# The slowest files first (worker-seconds measured in CI), so that no slow file starts last and runs
# alone while the other worker sits idle. pytest-xdist (--dist loadfile --no-loadscope-reorder) hands
# out files in collection order; by default it would reorder them by their count of tests.
SLOWEST_FIRST = ["test_gpt_parity.py", "test_checkpoint_resume.py", "test_graph_run.py", "test_graph_parity.py",
                 "test_train_run.py", "test_entry_points.py", "test_faults.py", "test_video_objectives.py",
                 "test_bench_graph.py", "test_video_generator.py", "test_vlm_parity.py", "test_video_parity.py",
                 "test_dna_vlm_parity.py", "test_fault_guard.py", "test_user_kind.py", "test_fan_out_parity.py",
                 "test_nonfinite_steps.py", "test_launch.py", "test_bench_throughput.py"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order
