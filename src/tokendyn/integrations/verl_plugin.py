"""verl's plugin entry point (``[project.entry-points."verl.plugins"]``): `import verl` imports this module in every
worker, and this module imports `tokendyn.integrations.verl`, which registers tokendyn's loss and wraps the actor
worker's update when it is imported (`tokendyn.integrations.verl.register`).

Either import order works: verl first (its plugin loop imports the package, which registers), or tokendyn first (its
loss module imports verl, whose plugin loop finds the package half-imported and leaves it: the package registers when
its own import finishes). verl swallows an exception raised while it loads a plugin (logged at debug level), so a
failure here is made loud first: a warning naming what failed, then the exception itself."""

from __future__ import annotations

import warnings

try:
    import tokendyn.integrations.verl  # noqa: F401  (registers on import)
except Exception as exc:  # noqa: BLE001 - reported, then raised again
    warnings.warn(f"tokendyn: the verl plugin did not load: {type(exc).__name__}: {exc}", stacklevel=2)
    raise
