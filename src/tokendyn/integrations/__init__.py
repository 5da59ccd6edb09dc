"""Glue for other RL stacks, one module per stack: `verl` (a registered policy loss with Reweight and Lopti's stage
masks, loaded through verl's plugin entry point by `verl_plugin`). Nothing here is imported by the rest of
tokendyn, so a plain install needs none of these stacks."""
