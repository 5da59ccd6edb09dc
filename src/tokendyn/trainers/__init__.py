"""TRL's GRPO with tokendyn's remedies and probe (`grpo`, `config`), the runner and the CLI's train command.

TOKENDYN_NO_VLLM=1: this process samples with the trainer's own generate, so TRL (1.16 imports vLLM wherever it is
installed: 3-5 s at every start here) is told vLLM is absent before this room first imports TRL
(`tokendyn.integrations.trl_internals.hide_vllm`); a process that imported TRL earlier keeps its vLLM. A run with
use_vllm then fails in one line naming the variable (`trl_internals.vllm_builder`).
"""

import os
import sys

if os.environ.get("TOKENDYN_NO_VLLM") == "1" and "trl" not in sys.modules:
    from tokendyn.integrations.trl_internals import hide_vllm

    hide_vllm()
