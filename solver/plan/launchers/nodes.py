"""Per-node launch values: every node runs the same emitted script, and the environment says which node it is.

`NODE_RANK` (0 on the node that hosts the rendezvous), `MASTER_ADDR` (that node's address) and `MASTER_PORT`
default to a one-node run, so a single machine needs nothing set. Slurm sets them from its own variables.
"""

from __future__ import annotations

from solver.plan.launchers.common import launch_environment
from solver.plan.launchers.shell import Env, command_line, comment, env, exports, joined
from solver.plan.record import Plan

DEFAULT_PORT = "29500"  # torch.distributed's default master port
NODE_RANK = env("NODE_RANK", "0")
MASTER_ADDR = env("MASTER_ADDR", "127.0.0.1")
MASTER_PORT = env("MASTER_PORT", DEFAULT_PORT)


def nodes_note(plan: Plan) -> str:
    """How to start the script on each node, in words (a comment in the launch script)."""
    nodes = plan.inputs.cluster.nodes
    if nodes == 1:
        return "One node: run as is (NODE_RANK, MASTER_ADDR and MASTER_PORT default to a local run)."
    return (f"{nodes} nodes: run this script on every node with NODE_RANK=0..{nodes - 1} and MASTER_ADDR set to "
            f"node 0's address (MASTER_PORT defaults to {DEFAULT_PORT}), or submit slurm_launch.sh where emitted.")


def torchrun_argv(plan: Plan) -> list[str | Env]:
    """`torchrun` with static rendezvous at node 0: --nnodes, this node's --node_rank and the master address."""
    cluster = plan.inputs.cluster
    return ["torchrun", "--nnodes", str(cluster.nodes), "--nproc_per_node", str(cluster.gpus_per_node),
            "--node_rank", NODE_RANK, "--master_addr", MASTER_ADDR, "--master_port", MASTER_PORT]


def hostfile(plan: Plan) -> str:
    """A DeepSpeed hostfile template: one `<host> slots=<GPUs>` line per node."""
    cluster = plan.inputs.cluster
    head = comment("DeepSpeed hostfile emitted by fitplan: replace node0.. with your hosts' names (reachable by "
                   "passwordless ssh from the node that runs deepspeed_launch.sh); slots = GPUs per node.")
    return head + "".join(f"node{i} slots={cluster.gpus_per_node}\n" for i in range(cluster.nodes))


def slurm_script(plan: Plan, program: list[str | Env], *, about: str) -> str:
    """An sbatch script: one task per node, each running torchrun with c10d rendezvous at the first node."""
    cluster = plan.inputs.cluster
    argv: list[str | Env] = [
        "srun", "torchrun", "--nnodes", str(cluster.nodes), "--nproc_per_node", str(cluster.gpus_per_node),
        "--rdzv_backend", "c10d", "--rdzv_id", env("SLURM_JOB_ID", "fitplan"),
        "--rdzv_endpoint", joined(env("MASTER_ADDR"), ":", MASTER_PORT), *program]
    return ("#!/usr/bin/env bash\n"
            f"#SBATCH --nodes={cluster.nodes}\n#SBATCH --ntasks-per-node=1\n"
            f"#SBATCH --gpus-per-node={cluster.gpus_per_node}\n"
            + comment(about) + comment("Submit with sbatch; the first node of the allocation hosts the rendezvous.")
            + 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"\nexport MASTER_ADDR\n'
            + exports(launch_environment(plan)) + command_line(argv) + ' "$@"\n')
