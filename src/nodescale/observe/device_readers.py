"""What the node monitor asks of the accelerators: utilisation, memory, temperature, power and energy.

One small protocol (:class:`DeviceReader`), two implementations:

- NVIDIA through NVML (``pynvml``, package nvidia-ml-py), imported only when a
  reader is looked for, so nodescale itself never needs it;
- AMD through the ``rocm-smi`` command and its ``--json`` output.

:func:`detect_reader` returns the first that works on this node, or None (no
driver, no tool, no device visible): quietly, since a CPU-only node is normal.
Both readers see only the devices this process may use (``CUDA_VISIBLE_DEVICES``
and its ROCm siblings), in the order the framework numbers them.

This module holds what touches the driver or starts the tool; the reading
type, the visibility rules and the ``rocm-smi`` parsers are pure functions in
:mod:`~nodescale.observe.device_parsing`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from nodescale.observe.device_parsing import (
    DeviceSample,
    cuda_visible_indices,
    rocm_smi_cards,
    rocm_smi_name,
    rocm_smi_sample,
    rocm_visible_indices,
)


class DeviceReader(Protocol):
    """The devices of this process, read together; ``sample()`` is in the order of ``names()``."""

    def names(self) -> list[str]:
        """One name per device, e.g. ``"cuda:0 NVIDIA H100 80GB HBM3"``."""
        ...

    def sample(self) -> list[DeviceSample]:
        """One reading per device; may raise, the monitor copes."""
        ...

    def close(self) -> None:
        """Release the library or tool; the reader is not used afterwards."""
        ...


def detect_reader(cuda_devices: str | None = None) -> DeviceReader | None:
    """NVML if it initialises and sees a device, else ``rocm-smi`` if it is on PATH and sees one, else None.

    ``cuda_devices`` (a CUDA_VISIBLE_DEVICES value) selects the NVIDIA GPUs instead of this
    process's CUDA_VISIBLE_DEVICES. Never raises: a node without accelerators (or without their
    tools) is a normal place to train, and the monitor then records the host only.
    """
    openers: tuple[Callable[[], DeviceReader | None], ...] = (lambda: NvmlReader.open(cuda_devices),
                                                              RocmSmiReader.open)
    for opener in openers:
        try:
            reader = opener()
        except Exception:  # noqa: BLE001 - a broken driver or tool means "no devices", not a failed run
            reader = None
        if reader is not None:
            return reader
    return None


# --- NVIDIA: NVML -------------------------------------------------------------------------------------------


class NvmlReader:
    """NVIDIA GPUs through NVML: each quantity one library call, no process started.

    A quantity a GPU answers "not supported" to (energy before Volta, most
    things on a MIG-enabled GPU) is not asked again: the answer will not change.
    """

    def __init__(self, nvml: Any, handles: Sequence[Any], names: Sequence[str]) -> None:
        self._nvml = nvml
        self._handles = list(handles)
        self._names = list(names)
        self._unsupported: set[tuple[int, str]] = set()

    @classmethod
    def open(cls, cuda_devices: str | None = None) -> NvmlReader | None:
        """Initialise NVML and pick the GPUs ``cuda_devices`` (default: CUDA_VISIBLE_DEVICES) names.

        None without pynvml, a driver or a visible GPU.
        """
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded...: no NVIDIA GPU here
            return None
        try:
            count = pynvml.nvmlDeviceGetCount()
            all_handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
            uuids = [_text(pynvml.nvmlDeviceGetUUID(handle)) for handle in all_handles]
            value = cuda_devices if cuda_devices is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
            migs = _mig_parents(pynvml, all_handles) if value and "mig-" in value.lower() else {}
            visible = cuda_visible_indices(value, uuids, migs)
            handles = [all_handles[index] for index in visible]
            names = [f"cuda:{ordinal} {_text(pynvml.nvmlDeviceGetName(handle))}"
                     for ordinal, handle in enumerate(handles)]
        except Exception:  # noqa: BLE001 - a half-working driver: treat as no GPU rather than fail the run
            pynvml.nvmlShutdown()
            return None
        if not handles:
            pynvml.nvmlShutdown()
            return None
        return cls(pynvml, handles, names)

    def names(self) -> list[str]:
        """``cuda:N <product name>`` per visible GPU, N counting as the framework does."""
        return list(self._names)

    def sample(self) -> list[DeviceSample]:
        """One reading per visible GPU: a few NVML calls each, microseconds."""
        nvml = self._nvml
        samples = []
        for index, handle in enumerate(self._handles):
            util = self._ask(index, "util", lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu, handle)
            memory = self._ask(index, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
            temp = self._ask(index, "temp", lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
                             handle)
            milliwatts = self._ask(index, "power", nvml.nvmlDeviceGetPowerUsage, handle)
            millijoules = self._ask(index, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption, handle)  # Volta+
            samples.append(DeviceSample(
                util_percent=None if util is None else float(util),
                mem_used_bytes=None if memory is None else int(memory.used),
                mem_total_bytes=None if memory is None else int(memory.total),
                temp_c=None if temp is None else float(temp),
                power_w=None if milliwatts is None else milliwatts / 1000.0,
                energy_j=None if millijoules is None else millijoules / 1000.0,
            ))
        return samples

    def _ask(self, index: int, what: str, call: Callable[[Any], Any], handle: Any) -> Any:
        if (index, what) in self._unsupported:
            return None
        try:
            return call(handle)
        except self._nvml.NVMLError_NotSupported:
            self._unsupported.add((index, what))
            return None
        except self._nvml.NVMLError:  # a transient failure (GPU busy resetting, say): an empty cell this time
            return None

    def close(self) -> None:
        """Shut NVML down (its init is reference-counted, so a framework's own use is unaffected)."""
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a library that is already gone is no error
            pass


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older pynvml returns bytes


def _mig_parents(nvml: Any, handles: Sequence[Any]) -> dict[str, int]:
    """MIG device UUID -> NVML index of its GPU, for the GPUs in MIG mode."""
    parents: dict[str, int] = {}
    for index, handle in enumerate(handles):
        try:
            slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        except nvml.NVMLError:
            continue
        for slot in range(slots):
            try:
                parents[_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)))] = index
            except nvml.NVMLError:  # an empty slot
                continue
    return parents


# --- AMD: rocm-smi ------------------------------------------------------------------------------------------

ROCM_SMI = "rocm-smi"
ROCM_SAMPLE_ARGS = ("--showuse", "--showmemuse", "--showmeminfo", "vram", "--showtemp", "--showpower", "--json")
ROCM_ENERGY_ARGS = ("--showenergycounter",)  # absent from older rocm-smi, which then refuses the whole command
ROCM_NAME_ARGS = ("--showproductname", "--showuniqueid", "--json")
ROCM_TIMEOUT_S = 10.0  # rocm-smi is a Python program: a second is normal, ten means it is stuck


class RocmSmiReader:
    """AMD GPUs through ``rocm-smi --json``: one run of the tool per sample (a short Python process).

    That costs far more than an NVML call (a fraction of a second of one
    core), which is why the monitor's interval defaults to seconds.
    """

    def __init__(self, executable: str, args: Sequence[str], cards: Sequence[int], names: Sequence[str]) -> None:
        self._command = [executable, *args]
        self._cards = list(cards)
        self._names = list(names)

    @classmethod
    def open(cls) -> RocmSmiReader | None:
        """Find ``rocm-smi`` on PATH, learn whether it has an energy counter, and pick the visible cards."""
        executable = shutil.which(ROCM_SMI)
        if executable is None:
            return None
        args: tuple[str, ...] = ()
        cards: dict[int, dict[str, str]] = {}
        for candidate in (ROCM_SAMPLE_ARGS + ROCM_ENERGY_ARGS, ROCM_SAMPLE_ARGS):
            cards = rocm_smi_cards(_run(executable, candidate))
            if cards:
                args = candidate
                break
        if not cards:
            return None
        described = rocm_smi_cards(_run(executable, ROCM_NAME_ARGS))
        unique_ids = {card: fields.get("unique id", "") for card, fields in described.items()}
        visible = rocm_visible_indices(list(cards), unique_ids, os.environ)
        if not visible:
            return None
        names = [f"cuda:{ordinal} {rocm_smi_name(described.get(card, {}))}" for ordinal, card in enumerate(visible)]
        return cls(executable, args, visible, names)

    def names(self) -> list[str]:
        """``cuda:N <product name>`` per visible card (PyTorch on ROCm names its devices cuda too)."""
        return list(self._names)

    def sample(self) -> list[DeviceSample]:
        """One run of rocm-smi; a card missing from its output gets an empty reading."""
        cards = rocm_smi_cards(_run(self._command[0], self._command[1:]))
        return [rocm_smi_sample(cards[card]) if card in cards else DeviceSample() for card in self._cards]

    def close(self) -> None:
        """Nothing to release: no state is held between runs of the tool."""


def _run(executable: str, args: Sequence[str]) -> str:
    """stdout of ``executable args``, or "" if it failed to start or ran too long.

    The exit status is not looked at: rocm-smi exits non-zero when any one
    figure was unavailable (the power of a secondary die, say) yet prints the
    rest; an option it does not know leaves stdout empty, which parses as no cards.
    """
    try:
        done = subprocess.run([executable, *args], capture_output=True, text=True, timeout=ROCM_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout
