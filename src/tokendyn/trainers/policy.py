"""The policy loader and builder, re-exported from :mod:`tokendyn.policy` (where it lives, so that hooks/ and
probe-side commands load a policy without importing trainers/); this module keeps the old import path working."""

from tokendyn.policy import (
    EMBEDDED_DIR,
    EOS,
    MARKER,
    TAGS,
    ModelPreset,
    build_model,
    check_model_source,
    default_policy_dir,
    load_policy,
    load_tokenizer,
    save_policy,
    train_tokenizer,
)

__all__ = [
    "EMBEDDED_DIR",
    "EOS",
    "MARKER",
    "TAGS",
    "ModelPreset",
    "build_model",
    "check_model_source",
    "default_policy_dir",
    "load_policy",
    "load_tokenizer",
    "save_policy",
    "train_tokenizer",
]
