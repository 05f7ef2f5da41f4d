"""Which output tile a program of the experts GEMMs computes (the launch grid's order)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_tile(pid, num_blocks_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` over num_blocks_m row blocks x cdiv(N, BLOCK_N) column tiles, in groups of
    GROUP_M row blocks (the programs of a group share weight tiles in L2), as in Triton's matmul tutorial."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_blocks_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n
