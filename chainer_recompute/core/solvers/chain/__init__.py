"""Chain (RNN) policies: Gruslys et al.'s BPTT-HSM, -ISM and -MSM and
Griewank's revolve, for a chain of ``t`` steps of one recurrent cell.

The package's parts, one job each (the recursions: docs/paper.md §7):

- :mod:`.tables`: the checks of a chain problem and the policies' DP
  tables (cached, grown on demand);
- :mod:`.schedules`: each policy as a stream of operations, its cost in
  forward steps, and a schedule's count of forward steps and slots;
- :mod:`.byte_simulator`: a schedule's peak in bytes from one step's
  measured sizes;
- :mod:`.plain_bptt`: plain BPTT's peak in bytes, in the order Chainer's
  backward runs the whole unroll.

Pure core: numpy only. Every public name is importable from this package.
"""
from .byte_simulator import ByteSizes, CallBytes, simulate_bytes
from .plain_bptt import StepFunction, StepGraph, plain_peak_bytes, replay_plain
from .schedules import (hsm_policy, plain_schedule, policy_cost, revolve_beta,
                        revolve_min_forward_steps, revolve_split, schedule, simulate_slots)
from .tables import (POLICIES, ChainTable, bptt_hsm_table, bptt_ism_table,
                     bptt_msm_table, cached_tables, chain_table, check_chain,
                     clear_table_cache, max_useful_slots, table_cache_bytes)

__all__ = ["POLICIES", "ChainTable", "ByteSizes", "bptt_hsm_table", "bptt_ism_table",
           "bptt_msm_table", "cached_tables", "chain_table", "clear_table_cache",
           "table_cache_bytes", "hsm_policy",
           "max_useful_slots", "plain_schedule", "policy_cost", "revolve_beta",
           "revolve_min_forward_steps", "revolve_split", "schedule", "simulate_bytes",
           "simulate_slots", "check_chain", "CallBytes", "StepFunction", "StepGraph",
           "replay_plain", "plain_peak_bytes"]
