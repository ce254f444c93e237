"""Plans beyond one node launch as emitted: per-node ranks from the environment, a DeepSpeed hostfile, an
accelerate config for every process, a Slurm script; and a real 2-node gloo run from the emitted torchrun files."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from solver import solve
from solver.cli.commands import emit_files
from solver.plan.launchers.shell import command_line, env, joined
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values
from tests.solver.test_end_to_end import assert_states_as_priced

# Plans as users get them: torch.compile searched, as without FITPLAN_AUTO_COMPILE (tests/conftest.py).
pytestmark = pytest.mark.compile_search

BIN = str(Path(sys.executable).parent)


def bash_words(line: str, environment: dict[str, str]) -> list[str]:
    """The argv bash gives `line`'s command under `environment` (printed by printf, NUL-separated)."""
    done = subprocess.run(["bash", "-c", "printf '%s\\0' " + line], env={"PATH": "/usr/bin:/bin", **environment},
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.split("\0")[:-1]


def test_env_words_expand_variables_and_nothing_else(tmp_path):
    hostile = "a\"b$(touch PWNED)`touch PWNED`\\$HOME;*"
    line = command_line(["x", env("NODE_RANK", "0"), joined(env("MASTER_ADDR"), ":", env("PORT", "29500")),
                         joined(hostile, env("NODE_RANK", "0")), hostile])
    os.chdir(tmp_path)
    assert bash_words(line, {}) == ["x", "0", ":29500", hostile + "0", hostile]
    assert bash_words(line, {"NODE_RANK": "3", "MASTER_ADDR": "10.0.0.7", "PORT": "1234"}) == \
        ["x", "3", "10.0.0.7:1234", hostile + "3", hostile]
    assert not list(tmp_path.glob("PWNED*"))
    for bad in ("1; touch X", "$(id)", 'a"b'):
        with pytest.raises(ValueError):
            env("NODE_RANK", bad)
    with pytest.raises(ValueError):
        env("NODE-RANK")


@pytest.fixture(scope="module")
def deepspeed_two_nodes(tmp_path_factory) -> tuple[object, Path]:
    plan = solve("meta-llama/Llama-3.1-8B", "2x8xH100", engine="deepspeed", seq_len=2048, time_limit=10)
    folder = tmp_path_factory.mktemp("ds-2x8")
    emit_files(plan, "accelerate,deepspeed", folder)
    return plan, folder


def script_words(script: Path, environment: dict[str, str]) -> list[str]:
    """The command line of an emitted launch script (its last line), as bash expands it under `environment`."""
    line = script.read_text().rstrip("\n").splitlines()[-1]
    return bash_words(line.split(" ", 1)[1], environment)


def test_deepspeed_two_node_launch_reads_the_emitted_hostfile(deepspeed_two_nodes):
    from deepspeed.launcher.runner import fetch_hostfile, parse_args

    _, folder = deepspeed_two_nodes
    assert dict(fetch_hostfile(str(folder / "hostfile"))) == {"node0": 8, "node1": 8}
    args = parse_args(script_words(folder / "deepspeed_launch.sh", {"MASTER_ADDR": "10.0.0.1"}))
    assert (args.hostfile, args.num_nodes, args.num_gpus, args.master_addr) == ("hostfile", 2, 8, "10.0.0.1")
    # the user's train.py, through fitplan's entry where the plan needs what ds_config.json cannot say
    entry = (folder / "fitplan_deepspeed.py").exists()
    assert (args.user_script, args.user_args[:1]) == (("fitplan_deepspeed.py", ["train.py"]) if entry else
                                                      ("train.py", ["--deepspeed"]))


def test_deepspeeds_runner_starts_every_node_with_the_allocator_setting(deepspeed_two_nodes, monkeypatch):
    """DeepSpeed's pdsh runner passes on only some variables; the emitted .deepspeed_env adds the allocator's
    (the plan's memory assumes expandable segments: overhead.py). Run its own main() up to the pdsh command."""
    import subprocess

    from deepspeed.launcher import multinode_runner, runner

    class Started(Exception):
        pass

    def capture(cmd, **kwargs):
        raise Started(cmd)

    _, folder = deepspeed_two_nodes
    argv = script_words(folder / "deepspeed_launch.sh", {"MASTER_ADDR": "10.0.0.1"})
    monkeypatch.chdir(folder)
    monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: 0)  # the ssh reachability check
    monkeypatch.setattr(multinode_runner.PDSHRunner, "backend_exists", lambda self: True)
    monkeypatch.setattr(subprocess, "Popen", capture)
    with pytest.raises(Started) as started:
        runner.main(argv)
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True;" in " ".join(started.value.args[0])


def test_accelerate_two_node_config_and_launch_line_give_every_process_a_rank(deepspeed_two_nodes):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    _, folder = deepspeed_two_nodes
    loaded = load_config_from_file(str(folder / "accelerate_config.yaml"))
    assert (loaded.num_machines, loaded.num_processes) == (2, 16)
    assert loaded.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    words = script_words(folder / "accelerate_launch.sh", {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"})
    assert words[0] == "launch"
    words[words.index("--config_file") + 1] = str(folder / "accelerate_config.yaml")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(words[1:]))
    assert (args.num_processes, args.num_machines, args.machine_rank) == (16, 2, 1)
    assert (args.main_process_ip, args.main_process_port) == ("10.0.0.1", 29500)
    assert args.num_processes // args.num_machines == 8  # per node, as accelerate's standard launcher starts them


def test_slurm_script_starts_one_torchrun_per_node_with_c10d_rendezvous(tmp_path):
    # launcher pinned: under a loaded machine the 10 s search can stop at an FSDP2 pipeline torchrun refuses
    plan = solve("meta-llama/Llama-3.1-8B", "2x8xH100", engine="fsdp2", seq_len=2048, time_limit=10,
                 launcher="torchrun")
    emit_files(plan, "torchrun", tmp_path)
    script = (tmp_path / "slurm_launch.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\n'\n")
    (fake / "srun").write_text("#!/bin/sh\nprintf '%s\\0' \"$@\" > \"$OUT\"\n")
    for name in ("scontrol", "srun"):
        (fake / name).chmod(0o755)
    out = tmp_path / "argv"
    subprocess.run(["bash", str(tmp_path / "slurm_launch.sh"), "--steps", "3"], cwd=tmp_path, check=True, timeout=30,
                   env={"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(out), "SLURM_JOB_ID": "42",
                        "SLURM_JOB_NODELIST": "gpu-[a-b]"})
    argv = out.read_text().split("\0")[:-1]
    assert argv[:5] == ["torchrun", "--nnodes", "2", "--nproc_per_node", "8"]
    assert argv[argv.index("--rdzv_endpoint") + 1] == "gpu-a:29500"
    assert argv[argv.index("--rdzv_id") + 1] == "42"
    assert argv[-2:] == ["--steps", "3"] and "train_fitplan.py" in argv


NODES, PER_NODE, STEPS = 2, 2, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_two_node_gloo_run_from_the_emitted_torchrun_script(engine, tmp_path):
    """Two 'nodes' (separate torchrun agents with their own NODE_RANK on 127.0.0.1), two ranks each, train two
    steps from torchrun_launch.sh; each rank's bytes match the plan's estimate as in test_end_to_end."""
    model_dir = write_config(tmp_path / "tiny-llama", tiny_values("llama"))
    # States stay on the device, so the report's local bytes compare with the device estimate.
    plan = solve(str(model_dir), f"{NODES}x{PER_NODE}xCPU", seq_len=64, global_batch=8, time_limit=5, engine=engine,
                 offload="none", param_offload="none", tp=1)
    assert plan.decisions.dp == NODES * PER_NODE
    folder = tmp_path / "out"
    emit_files(plan, "torchrun", folder)
    report = tmp_path / "report"
    port = str(free_port())
    base = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port}
    args = ["--from-config", "--steps", str(STEPS), "--report", str(report)]
    nodes = [subprocess.Popen(["bash", "torchrun_launch.sh", *args], cwd=folder, env={**base, "NODE_RANK": str(n)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in range(NODES)]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in outputs)
    reports = [json.loads((report / f"rank{rank}.json").read_text()) for rank in range(NODES * PER_NODE)]
    assert_states_as_priced(plan, reports)
    losses = [float(x) for x in re.findall(r"loss (\S+)", outputs[0])]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)
    launch = (folder / "torchrun_launch.sh").read_text()
    assert shlex.split(launch.splitlines()[-1])[:3] == ["torchrun", "--nnodes", "2"]
