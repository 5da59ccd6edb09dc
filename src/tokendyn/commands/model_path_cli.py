"""``tokendyn model-path NAME``: the local directory a model source resolves to, for a stack that loads models itself.

verl, vLLM or a script of one's own read a Hugging Face directory or hub id; a packaged model (``smollm2-135m``) or a
``.gguf`` file means nothing to them. This prints the directory tokendyn would load it from (converted once into the
tokendyn cache, `tokendyn.packaged`), a local directory as it is, a hub id unchanged (those stacks resolve it
themselves), so that one resolver serves every entry point::

    python -m verl.trainer.main_ppo actor_rollout_ref.model.path=$(tokendyn model-path smollm2-135m) ...
"""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "model-path",
        help="the local directory of a model source (a packaged name such as smollm2-135m, a .gguf file, a "
        "directory; a hub id is printed unchanged), for stacks that load models themselves (verl)",
    )
    p.add_argument("model", help="smollm2-135m, a .gguf file, a model directory or a hub id (owner/name)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokendyn.common import UsageError
    from tokendyn.packaged import resolve
    from tokendyn.policy import check_model_source

    path = resolve(args.model, "model")
    try:
        check_model_source(path, "model")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(path)
    return 0
