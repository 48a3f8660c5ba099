"""Whether torchrun's ``--numa-binding=node`` can bind this node's ranks; the job script asks on each node.

torchrun has no fallback: where binding fails (a CPU-only torch on nodes with GPU gres, a VM whose
GPUs report NUMA node -1) the whole step fails. So the option is passed only where it can work and
helps: a torch that has it and was built for CUDA or ROCm, more than one NUMA node, and every GPU
on a known one. Read from files, without importing torch (the ranks import it soon enough)::

    numa_binding=$(python3 -m nodescale.launch.numa_binding 2>/dev/null) || numa_binding=
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

GPU_VENDORS = ("0x10de", "0x1002")  # NVIDIA, AMD
OPTION = "--numa-binding=node"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def torch_can_bind(torch_dir: Path) -> bool:
    """This torch has torchrun's NUMA binding and a GPU build (``version.py``: ``cuda`` or ``hip`` set)."""
    built = re.search(r"^(cuda|hip)\b[^=\n]*=\s*['\"]\d", _read(torch_dir / "version.py"), re.M)
    return bool(built) and (torch_dir / "numa" / "binding.py").is_file()


def gpus_on_known_numa_nodes(sys_root: Path) -> bool:
    """More than one NUMA node, and every NVIDIA/AMD display controller on one of them."""
    if len(list((sys_root / "devices/system/node").glob("node[0-9]*"))) < 2:
        return False
    gpus = [device for device in (sys_root / "bus/pci/devices").glob("*")
            if _read(device / "vendor") in GPU_VENDORS and _read(device / "class").startswith("0x03")]
    return bool(gpus) and all(_read(gpu / "numa_node").isdigit() for gpu in gpus)  # -1: unknown


def applies(torch_dir: Path | None, sys_root: Path = Path("/sys")) -> bool:
    return torch_dir is not None and torch_can_bind(torch_dir) and gpus_on_known_numa_nodes(sys_root)


def main() -> None:
    spec = importlib.util.find_spec("torch")
    torch_dir = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
    print(OPTION if applies(torch_dir) else "")


if __name__ == "__main__":
    main()
    sys.exit(0)
