#!/bin/bash
# Ulysses SP inside each node (8 GPUs over NVLink), data parallelism across 2 nodes.
#   sbatch configs/slurm_2x8.sh train.py [args...]
#   sbatch configs/slurm_2x8.sh -m lightning_ulysses fit --config <config.yaml> --trainer.num_nodes 2 --trainer.devices 8
# The script's Trainer must say devices=8, num_nodes=2 (Lightning checks them against SLURM's numbers).
# One task per GPU: Lightning's SLURMEnvironment reads SLURM_PROCID / SLURM_LOCALID / SLURM_NODEID and derives
# MASTER_ADDR from the node list, so ranks are numbered node by node and each SP group of 8 stays on one node.
#SBATCH --job-name=ulysses-2x8
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --output=%x-%j.out

set -euo pipefail

export MASTER_PORT=${MASTER_PORT:-29500}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # long sequences fragment the allocator otherwise
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK}

srun --kill-on-bad-exit=1 python "$@"
