"""The pure half of the device readers: text in, device indices or readings out, nothing run or loaded.

- :class:`DeviceSample`, one reading of one device, which every reader returns;
- which devices this process sees, from ``CUDA_VISIBLE_DEVICES`` and its ROCm
  siblings (:func:`cuda_visible_indices`, :func:`rocm_visible_indices`);
- what a ``rocm-smi ... --json`` output says (:func:`rocm_smi_cards`,
  :func:`rocm_smi_sample`, :func:`rocm_smi_name`).

Kept apart from :mod:`~nodescale.observe.device_readers`, which talks to the
driver and the tool, so that these can be tested without either: the key
spellings of several ROCm versions are checked on recorded outputs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


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


# --- AMD: what rocm-smi says --------------------------------------------------------------------------------

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
