"""Put on PYTHONPATH by benchmarks/startup.py: stamps each process's first optimiser step.

Registers torch's global optimiser post-step hook when ``torch.optim.optimizer`` is first
imported (an import hook, so no process imports torch earlier than it would), times ``import
torch``, and writes each process's record into ``$STARTUP_STAMP_DIR`` at its first step and at
exit. Imports nothing beyond sys, os and time up front, so it adds nothing measurable to any
interpreter's start. Inert without ``STARTUP_STAMP_DIR``.
"""
import os
import sys
import time

_DIR = os.environ.get("STARTUP_STAMP_DIR")
_STATE = {"pid": os.getpid(), "started": time.time(), "torch_import_started": None, "torch_import_ended": None,
          "first_step": None, "rank": None, "steps": 0}


def _write(kind):
    import json

    _STATE["argv"] = sys.argv[:4]
    _STATE["pid"] = os.getpid()  # a rank forked by nodescale's fork server inherits the server's record
    times = os.times()
    _STATE["cpu_seconds"] = times.user + times.system  # this process's own, up to now
    with open(os.path.join(_DIR, f"{kind}-{os.getpid()}.json"), "w") as handle:
        json.dump(_STATE, handle)


def _post_step(optimizer, args, kwargs):
    _STATE["steps"] += 1
    if _STATE["steps"] == 1:
        _STATE["first_step"] = time.time()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            _STATE["rank"] = dist.get_rank()
        else:
            _STATE["rank"] = int(os.environ.get("RANK", "-1"))
        _write("first")  # at once: a process that dies later still leaves its first step


class _Finder:
    """Wraps the loaders of torch (to time its import) and torch.optim.optimizer (to add the hook)."""

    names = ("torch", "torch.optim.optimizer")

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        original = spec.loader.exec_module

        def exec_module(module):
            if name == "torch":
                _STATE["torch_import_started"] = time.time()
            original(module)
            if name == "torch":
                _STATE["torch_import_ended"] = time.time()
            else:
                module.register_optimizer_step_post_hook(_post_step)

        spec.loader.exec_module = exec_module
        return spec


if _DIR:
    import atexit

    sys.meta_path.insert(0, _Finder())
    atexit.register(_write, "exit")
