"""TRL's GRPO with tokendyn's remedies and probe (`grpo`, `config`), the runner and the CLI's train command.

TOKENDYN_NO_VLLM=1: this process samples with the trainer's own generate, so TRL (1.16 imports vLLM wherever it is
installed: 3-5 s at every start here) is told vLLM is absent before this room first imports TRL; a process that
imported TRL earlier keeps its vLLM. A run with use_vllm then fails in TRL's own one line (vLLM not available).
"""

import os
import sys

if os.environ.get("TOKENDYN_NO_VLLM") == "1" and "trl" not in sys.modules:
    import trl.import_utils as _trl_imports

    _trl_imports.is_vllm_available = lambda min_version=None: False
