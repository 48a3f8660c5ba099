"""What the node monitor asks of the accelerators: utilisation, memory, temperature, power and energy.

One small protocol (:class:`DeviceReader`), two implementations:

- NVIDIA through NVML (``pynvml``, package nvidia-ml-py), imported only when a
  reader is looked for, so nodescale itself never needs it;
- AMD through the ``rocm-smi`` command and its ``--json`` output.

:func:`detect_reader` returns the first that works on this node, or None (no
driver, no tool, no device visible): quietly, since a CPU-only node is normal.
Both readers see only the devices this process may use (``CUDA_VISIBLE_DEVICES``
and its ROCm siblings), in the order the framework numbers them.

The ``rocm-smi`` parsers are pure functions (text in, samples out), so the
key spellings of several ROCm versions are tested on recorded outputs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class DeviceSample:
    """One reading of one device; None where the device or its driver does not report the quantity.

    ``energy_j`` is the device's own cumulative counter, from an origin of its
    choosing (driver load, usually): only differences between readings mean anything.
    """

    util_percent: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temp_c: float | None = None
    power_w: float | None = None
    energy_j: float | None = None


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


# --- which devices this process sees -------------------------------------------------------------------------


def cuda_visible_indices(value: str | None, uuids: Sequence[str], mig_parents: Mapping[str, int] | None = None
                         ) -> list[int]:
    """The NVML indices of the GPUs that ``CUDA_VISIBLE_DEVICES=value`` leaves visible, in CUDA's order.

    ``uuids`` are the NVML UUIDs by NVML index (``GPU-8932f937-...``). A token
    is an index, a GPU UUID or a unique prefix of one (with or without
    ``GPU-``), or a MIG device (``MIG-<uuid>`` looked up in ``mig_parents``,
    or the older ``MIG-GPU-<uuid>/gi/ci``), which counts as its whole parent
    GPU: NVML reports utilisation, power and energy per physical GPU. As CUDA
    does, the list ends at the first token that names no device (``-1``, a
    typo, a repeat), and an unset variable means every GPU.

    Indices are NVML's (PCI bus order); CUDA numbers devices fastest-first
    unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which is the same order on nodes
    of identical GPUs (the HPC case) and may differ on mixed ones.
    """
    if value is None:
        return list(range(len(uuids)))
    lowered = [uuid.lower() for uuid in uuids]
    parents = {key.lower(): index for key, index in (mig_parents or {}).items()}
    visible: list[int] = []
    for raw in value.split(","):
        index = _cuda_token_index(raw.strip().lower(), lowered, parents)
        if index is None or index in visible:
            break
        visible.append(index)
    return visible


def _cuda_token_index(token: str, uuids: Sequence[str], mig_parents: Mapping[str, int]) -> int | None:
    if re.fullmatch(r"\d+", token):
        return int(token) if int(token) < len(uuids) else None
    if token.startswith("mig-"):
        if token in mig_parents:
            return mig_parents[token]
        token = token[len("mig-"):].split("/")[0]  # MIG-GPU-<uuid>/gi/ci: the parent's UUID comes first
        if not token.startswith("gpu-"):
            return None
    if not token:
        return None
    prefix = token if token.startswith("gpu-") else f"gpu-{token}"
    matches = [index for index, uuid in enumerate(uuids) if uuid.startswith(prefix)]
    return matches[0] if len(matches) == 1 else None  # an ambiguous prefix names no device


def rocm_visible_indices(cards: Sequence[int], unique_ids: Mapping[int, str], environ: Mapping[str, str]
                         ) -> list[int]:
    """The ``rocm-smi`` card indices this process sees, in HIP's order.

    ``ROCR_VISIBLE_DEVICES`` (indices or ``GPU-<unique id>``) selects first;
    ``HIP_VISIBLE_DEVICES`` (or, when unset, ``CUDA_VISIBLE_DEVICES``, which
    HIP also honours) then picks by position among those. An invalid token
    ends a list, as in the runtimes. rocm-smi's card order is taken to be the
    runtime's, which holds on the usual node of identical GPUs.
    """
    visible = sorted(cards)
    rocr = environ.get("ROCR_VISIBLE_DEVICES")
    if rocr is not None:
        by_uid = {uid.lower().removeprefix("0x"): card for card, uid in unique_ids.items()}
        chosen: list[int] = []
        for raw in rocr.split(","):
            token = raw.strip().lower()
            card = None
            if re.fullmatch(r"\d+", token):
                card = visible[int(token)] if int(token) < len(visible) else None
            elif token.startswith("gpu-"):
                card = by_uid.get(token[len("gpu-"):].removeprefix("0x"))
            if card is None or card in chosen:
                break
            chosen.append(card)
        visible = chosen
    hip = environ.get("HIP_VISIBLE_DEVICES", environ.get("CUDA_VISIBLE_DEVICES"))
    if hip is not None:
        picked: list[int] = []
        for raw in hip.split(","):
            token = raw.strip()
            if not re.fullmatch(r"\d+", token) or int(token) >= len(visible) or visible[int(token)] in picked:
                break
            picked.append(visible[int(token)])
        visible = picked
    return visible


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

# Key spellings differ between ROCm versions (``(C)`` or ``(c)``, ``mem`` or ``memory``, the power key of
# MI300): keys are compared in lower case and the first one present with a number wins.
_UTIL_KEYS = ("gpu use (%)",)
_TEMP_SENSORS = ("edge", "junction", "memory", "mem")  # edge when reported (MI300X reports junction only)
_POWER_KEYS = ("average graphics package power (w)", "current socket graphics package power (w)")
_NAME_KEYS = ("card series", "device name", "card model")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def rocm_smi_cards(text: str) -> dict[int, dict[str, str]]:
    """The per-card fields of a ``rocm-smi ... --json`` output: card index -> {lower-cased key: value}.

    Text before the JSON (a warning some versions print) and after it is
    ignored, as are non-card entries (``system``); anything unreadable gives {}.
    """
    start = text.find("{")
    if start < 0:
        return {}
    try:
        data, _ = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return {}
    if not isinstance(data, dict):
        return {}
    cards: dict[int, dict[str, str]] = {}
    for key, fields in data.items():
        match = re.fullmatch(r"card(\d+)", str(key).strip(), re.IGNORECASE)
        if match and isinstance(fields, dict):
            cards[int(match.group(1))] = {str(k).strip().lower(): str(v) for k, v in fields.items()}
    return cards


def rocm_smi_sample(fields: Mapping[str, str]) -> DeviceSample:
    """One card's reading from its (lower-cased) ``rocm-smi --json`` fields; None for what it lacks or says N/A."""
    temp = None
    for sensor in _TEMP_SENSORS:
        temp = _first_number(fields, [key for key in fields if key.startswith(f"temperature (sensor {sensor})")])
        if temp is not None:
            break
    used = _first_number(fields, ("vram total used memory (b)",))
    total = _first_number(fields, ("vram total memory (b)",))
    microjoules = _first_number(fields, ("accumulated energy (uj)",))
    return DeviceSample(
        util_percent=_first_number(fields, _UTIL_KEYS),
        mem_used_bytes=None if used is None else int(used),
        mem_total_bytes=None if total is None else int(total),
        temp_c=temp,
        power_w=_first_number(fields, _POWER_KEYS),  # "N/A (Secondary die)" on the second die of an MI250X
        energy_j=None if microjoules is None else microjoules / 1e6,
    )


def rocm_smi_name(fields: Mapping[str, str]) -> str:
    """The product name of a card from ``--showproductname`` fields (key spelling varies by version)."""
    for key in _NAME_KEYS:
        value = fields.get(key, "").strip()
        if value and value.upper() != "N/A":
            return value
    return "AMD GPU"


def _first_number(fields: Mapping[str, str], keys: Sequence[str]) -> float | None:
    for key in keys:
        value = fields.get(key)
        if value is None or value.strip().upper().startswith("N/A"):
            continue
        match = _NUMBER.search(value)
        if match:
            return float(match.group(0))
    return None


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
