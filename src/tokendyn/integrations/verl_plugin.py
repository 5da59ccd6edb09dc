"""verl's plugin entry point (``[project.entry-points."verl.plugins"]``): `import verl` imports this module in every
worker, and this module registers tokendyn's loss (`tokendyn.integrations.verl.register`).

verl swallows an exception raised while it loads a plugin (logged at debug level), so a failure here is made loud
first: a warning naming what failed, then the exception itself."""

from __future__ import annotations

import warnings

try:
    from tokendyn.integrations.verl import register

    register()
except Exception as exc:  # noqa: BLE001 - reported, then raised again
    warnings.warn(f"tokendyn: the verl plugin did not load: {type(exc).__name__}: {exc}", stacklevel=2)
    raise
