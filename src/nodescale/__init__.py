"""nodescale: distributed PyTorch training from one GPU to many nodes.

The library API for your own scripts (``nodescale.init``) is imported lazily,
so ``import nodescale`` and ``nodescale --help`` stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from nodescale import preemption
    from nodescale.api import Context, init
    from nodescale.spawning import spawn

__all__ = ["Context", "init", "preemption", "spawn", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("init", "Context"):
        from nodescale import api

        return getattr(api, name)
    if name == "spawn":
        from nodescale.spawning import spawn

        return spawn
    if name == "preemption":  # the module: `import nodescale` then nodescale.preemption.requested()
        import importlib

        return importlib.import_module("nodescale.preemption")
    raise AttributeError(f"module 'nodescale' has no attribute {name!r}")
