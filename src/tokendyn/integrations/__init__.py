"""Glue for other RL stacks and engines, one module per stack: `verl` (a registered policy loss with Reweight and
Lopti's stage masks, loaded through verl's plugin entry point by `verl_plugin`) and `vllm_cpu` (vLLM's CPU build as
TRL's colocated sampler, which the TRL trainer builds through), and `trl_internals` (every TRL name tokendyn leans
on beyond TRL's documented API, with its `check()`). None imports its stack at module level, so a plain
install needs none of them."""
