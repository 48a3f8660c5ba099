"""Catch misspelt communication variables before a job burns its allocation.

NCCL, libfabric, PyTorch and MIOpen read their settings from environment
variables and say nothing about names they do not know: ``NCCL_DISABLE_IB=1``
and ``NCCL_NET_GDR_LEVEL=PBH`` (both in the seed job scripts) silently do
nothing. :func:`check_env` looks at every variable of the families below and

- raises :class:`UserError` for a name that is not known but is one typo (or a
  reordering of words) away from a known one, for a known name in the wrong
  case, and for a value its library would reject or ignore;
- returns warnings for names of a family that match nothing known (new
  releases add variables: those must pass) and for old names with a new one.

The known names are data, one ``frozenset`` per family, each with the
releases it was read from. Adding a variable is a one-line change there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nodescale.errors import UserError

# NCCL: NVIDIA's "Environment Variables" page for NCCL 2.21-2.27 (docs.nvidia.com/deeplearning/nccl),
# plus names its source reads but the page does not list (NCCL_PARAM names as mirrored in RCCL's
# source, late 2025), and names earlier releases documented and still accepted (NCCL_RINGS, ...).
NCCL_NAMES = frozenset({
    # system configuration
    "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY", "NCCL_SOCKET_RETRY_CNT", "NCCL_SOCKET_RETRY_SLEEP_MSEC",
    "NCCL_SOCKET_POLL_TIMEOUT_MSEC", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD", "NCCL_SOCKET_INLINE",
    "NCCL_SOCKET_MIN_TASKSIZE", "NCCL_SOCKET_RCVBUF", "NCCL_SOCKET_SNDBUF",
    "NCCL_CROSS_NIC", "NCCL_IB_HCA", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_IB_GID_INDEX",
    "NCCL_IB_ROUTABLE_FLID_GID_INDEX", "NCCL_IB_ADDR_FAMILY", "NCCL_IB_ADDR_RANGE", "NCCL_IB_ROCE_VERSION_NUM",
    "NCCL_IB_SL", "NCCL_IB_TC", "NCCL_IB_FIFO_TC", "NCCL_IB_RETURN_ASYNC_EVENTS", "NCCL_IB_PKEY",
    "NCCL_IB_USE_INLINE", "NCCL_IB_DATA_DIRECT", "NCCL_IB_MERGE_VFS", "NCCL_IB_MERGE_NICS",
    "NCCL_IB_WARN_RAIL_LOCAL", "NCCL_IB_MQP_RETRY_ALL", "NCCL_IB_MQP_RETRY_CNT", "NCCL_IB_MQP_RETRY_SLEEP_MSEC",
    "NCCL_OOB_NET_ENABLE", "NCCL_OOB_NET_IFNAME", "NCCL_UID_STAGGER_THRESHOLD", "NCCL_UID_STAGGER_RATE",
    "NCCL_NET", "NCCL_NET_PLUGIN", "NCCL_NET_PLUGIN_REF_COUNT", "NCCL_TUNER_PLUGIN", "NCCL_TUNER_CONFIG_FILE",
    "NCCL_PROFILER_PLUGIN", "NCCL_ENV_PLUGIN", "NCCL_IGNORE_CPU_AFFINITY", "NCCL_CONF_FILE", "NCCL_HOSTID",
    "NCCL_COMM_ID", "NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_TIMESTAMP_FORMAT",
    "NCCL_DEBUG_TIMESTAMP_LEVELS", "NCCL_WARN_ENABLE_DEBUG_INFO", "NCCL_COLLNET_ENABLE",
    "NCCL_COLLNET_NODE_THRESHOLD", "NCCL_CTA_POLICY", "NCCL_TOPO_FILE", "NCCL_TOPO_DUMP_FILE",
    "NCCL_TOPO_DUMP_FILE_RANK", "NCCL_GRAPH_FILE", "NCCL_GRAPH_DUMP_FILE", "NCCL_GRAPH_DUMP_FILE_RANK",
    "NCCL_SET_THREAD_NAME",
    # debugging and tuning
    "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_P2P_DIRECT_DISABLE", "NCCL_P2P_READ_ENABLE",
    "NCCL_P2P_USE_CUDA_MEMCPY", "NCCL_SHM_DISABLE", "NCCL_SHM_USE_CUDA_MEMCPY", "NCCL_SHM_MEMCPY_MODE",
    "NCCL_SHM_LOCALITY", "NCCL_BUFFSIZE", "NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE", "NCCL_NTHREADS",
    "NCCL_LL128_NTHREADS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS", "NCCL_NCHANNELS_PER_NET_PEER",
    "NCCL_NCHANNELS_PER_PEER", "NCCL_MIN_P2P_NCHANNELS", "NCCL_MAX_P2P_NCHANNELS", "NCCL_UNPACK_DOUBLE_NCHANNELS",
    "NCCL_CHECKS_DISABLE", "NCCL_CHECK_POINTERS", "NCCL_LAUNCH_MODE", "NCCL_IB_DISABLE", "NCCL_IB_AR_THRESHOLD",
    "NCCL_IB_QPS_PER_CONNECTION", "NCCL_IB_SPLIT_DATA_ON_QPS", "NCCL_IB_CUDA_SUPPORT",
    "NCCL_IB_PCI_RELAXED_ORDERING", "NCCL_IB_ADAPTIVE_ROUTING", "NCCL_IB_ECE_ENABLE", "NCCL_MEM_SYNC_DOMAIN",
    "NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ", "NCCL_NET_GDR_C2C", "NCCL_NET_SHARED_BUFFERS",
    "NCCL_NET_SHARED_COMMS", "NCCL_NET_OPTIONAL_RECV_COMPLETION", "NCCL_NET_OVERHEAD", "NCCL_NET_MERGE_LEVEL",
    "NCCL_NET_FORCE_MERGE", "NCCL_NET_FORCE_FLUSH", "NCCL_NET_DISABLE_INTRA", "NCCL_SINGLE_RING_THRESHOLD",
    "NCCL_LL_THRESHOLD", "NCCL_TREE_THRESHOLD", "NCCL_THREAD_THRESHOLDS", "NCCL_ALGO", "NCCL_PROTO",
    "NCCL_NVB_DISABLE", "NCCL_NVB_PRECONNECT", "NCCL_PXN_DISABLE", "NCCL_P2P_PXN_LEVEL", "NCCL_PXN_C2C",
    "NCCL_IGNORE_DISABLED_P2P", "NCCL_RUNTIME_CONNECT", "NCCL_GRAPH_REGISTER", "NCCL_LOCAL_REGISTER",
    "NCCL_LEGACY_CUDA_REGISTER", "NCCL_WIN_ENABLE", "NCCL_WIN_STRIDE", "NCCL_SET_STACK_SIZE",
    "NCCL_GRAPH_MIXING_SUPPORT", "NCCL_GRAPH_HELPER_DISABLE", "NCCL_DMABUF_ENABLE", "NCCL_P2P_NET_CHUNKSIZE",
    "NCCL_P2P_NVL_CHUNKSIZE", "NCCL_P2P_PCI_CHUNKSIZE", "NCCL_P2P_LL_THRESHOLD", "NCCL_ALLOC_P2P_NET_LL_BUFFERS",
    "NCCL_COMM_BLOCKING", "NCCL_COMM_SPLIT_SHARE_RESOURCES", "NCCL_COMM_SHRINK_SHARE_RESOURCES",
    "NCCL_CGA_CLUSTER_SIZE", "NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_NVLS_ENABLE", "NCCL_NVLS_CHUNKSIZE",
    "NCCL_NVLS_NCHANNELS", "NCCL_NVLSTREE_MAX_CHUNKSIZE", "NCCL_MNNVL_ENABLE", "NCCL_MNNVL_UUID",
    "NCCL_MNNVL_CLIQUE_ID", "NCCL_CUMEM_ENABLE", "NCCL_CUMEM_HOST_ENABLE", "NCCL_RAS_ENABLE", "NCCL_RAS_ADDR",
    "NCCL_RAS_TIMEOUT_FACTOR", "NCCL_LAUNCH_ORDER_IMPLICIT", "NCCL_LAUNCH_RACE_FATAL",
    "NCCL_NVLINK_UTIL_CENTRIC_SCHED_ENABLE", "NCCL_WORK_FIFO_BYTES", "NCCL_WORK_ARGS_BYTES",
    "NCCL_GDRCOPY_ENABLE", "NCCL_GDRCOPY_SYNC_ENABLE", "NCCL_GDRCOPY_FLUSH_ENABLE", "NCCL_GDRCOPY_FIFO_ENABLE",
    "NCCL_GDR_FLUSH_DISABLE", "NCCL_PAT_ENABLE", "NCCL_LL128_C2C", "NCCL_PROXY_APPEND_BATCH_SIZE",
    "NCCL_PROXY_DUMP_SIGNAL", "NCCL_PROGRESS_APPENDOP_FREQ", "NCCL_CREATE_THREAD_CONTEXT",
    "NCCL_CONNECT_ROUND_MAX_PEERS", "NCCL_REPORT_CONNECT_PROGRESS", "NCCL_L1_SHARED_MEMORY_CARVEOUT",
    # names from earlier releases, still read
    "NCCL_RINGS", "NCCL_MAX_NRINGS", "NCCL_MIN_NRINGS", "NCCL_IB_GDR_LEVEL",
    # PyTorch's names before 2.2 (ProcessGroupNCCL still reads them, with a deprecation warning)
    "NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT", "NCCL_DESYNC_DEBUG", "NCCL_ENABLE_TIMING",
})

# TORCH_NCCL: the names ProcessGroupNCCL reads in PyTorch 2.6-2.13 (torch/csrc/distributed/c10d headers),
# plus two of 2.2-2.5 (USE_COMM_NONBLOCKING, ABORT_IN_DESTROY_PG) that older installs still read.
TORCH_NCCL_NAMES = frozenset({
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_HIGH_PRIORITY",
    "TORCH_NCCL_AVOID_RECORD_STREAMS", "TORCH_NCCL_BCAST_UNIQUEID", "TORCH_NCCL_COORD_CHECK_MILSEC",
    "TORCH_NCCL_CUDA_EVENT_CACHE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_NCCL_DESYNC_DEBUG", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_ENABLE_TIMING", "TORCH_NCCL_EXTRA_DUMP_ON_EXEC", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN", "TORCH_NCCL_NAN_CHECK", "TORCH_NCCL_PROPAGATE_ERROR",
    "TORCH_NCCL_RANKS_PER_ROOT", "TORCH_NCCL_RETHROW_CUDA_ERRORS",
    "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_CPP_STACK", "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "TORCH_NCCL_USE_COMM_NONBLOCKING", "TORCH_NCCL_ABORT_IN_DESTROY_PG",
})

# FI: libfabric core (fi_provider(7), fi_mr(3)) and the CXI provider's runtime parameters (fi_cxi(7),
# libfabric 1.20-2.x and HPE's shs-libfabric), which Derecho's and LUMI's Slingshot job scripts set.
# Other providers' families (FI_EFA_*, FI_VERBS_*, FI_TCP_*, FI_SHM_*) pass with a warning.
FI_NAMES = frozenset({
    "FI_PROVIDER", "FI_PROVIDER_PATH", "FI_LOG_LEVEL", "FI_LOG_PROV", "FI_LOG_SUBSYS", "FI_UNIVERSE_SIZE",
    "FI_HMEM_CUDA_USE_GDRCOPY", "FI_HMEM_CUDA_ENABLE_XFER", "FI_MR_CACHE_MONITOR",
    "FI_MR_CACHE_MAX_SIZE", "FI_MR_CACHE_MAX_COUNT", "FI_MR_CUDA_CACHE_MONITOR_ENABLED",
    "FI_MR_ROCR_CACHE_MONITOR_ENABLED", "FI_MR_ZE_CACHE_MONITOR_ENABLED",
    "FI_CXI_ODP", "FI_CXI_ATS", "FI_CXI_ATS_MLOCK_MODE", "FI_CXI_RDZV_THRESHOLD", "FI_CXI_RDZV_GET_MIN",
    "FI_CXI_RDZV_EAGER_SIZE", "FI_CXI_RDZV_PROTO", "FI_CXI_DISABLE_NON_INJECT_MSG_IDC",
    "FI_CXI_DISABLE_HOST_REGISTER", "FI_CXI_OFLOW_BUF_SIZE", "FI_CXI_OFLOW_BUF_MIN_POSTED",
    "FI_CXI_OFLOW_BUF_COUNT", "FI_CXI_OFLOW_BUF_MAX_CACHED", "FI_CXI_SAFE_DEVMEM_COPY_THRESHOLD",
    "FI_CXI_OPTIMIZED_MRS", "FI_CXI_LLRING_MODE", "FI_CXI_CQ_POLICY", "FI_CXI_DEFAULT_VNI",
    "FI_CXI_EQ_ACK_BATCH_SIZE", "FI_CXI_RX_MATCH_MODE", "FI_CXI_HYBRID_PREEMPTIVE",
    "FI_CXI_HYBRID_RECV_PREEMPTIVE", "FI_CXI_HYBRID_POSTED_RECV_PREEMPTIVE",
    "FI_CXI_HYBRID_UNEXPECTED_MSG_PREEMPTIVE", "FI_CXI_REQ_BUF_SIZE", "FI_CXI_REQ_BUF_MIN_POSTED",
    "FI_CXI_REQ_BUF_MAX_CACHED", "FI_CXI_REQ_BUF_MAX_COUNT", "FI_CXI_MSG_LOSSLESS", "FI_CXI_FC_RETRY_USEC_DELAY",
    "FI_CXI_CTRL_RX_EQ_MAX_SIZE", "FI_CXI_DEFAULT_CQ_SIZE", "FI_CXI_DISABLE_EQ_HUGETLB",
    "FI_CXI_DISABLE_CQ_HUGETLB", "FI_CXI_DEFAULT_TX_SIZE", "FI_CXI_SW_RX_TX_INIT_MAX", "FI_CXI_DEVICE_NAME",
    "FI_CXI_TELEMETRY", "FI_CXI_TELEMETRY_RGID", "FI_CXI_CQ_FILL_PERCENT", "FI_CXI_COMPAT",
    "FI_CXI_COLL_FABRIC_MGR_URL", "FI_CXI_COLL_TIMEOUT_USEC", "FI_CXI_COLL_USE_DMA_PUT",
    "FI_CXI_DISABLE_HMEM_DEV_REGISTER", "FI_CXI_FORCE_ZE_HMEM_SUPPORT",
})

# OFI_NCCL: the AWS OFI NCCL plugin's variables (aws-ofi-nccl wiki "Environment Variables", 1.6-1.14),
# the plugin Derecho's NCCL_NET="AWS Libfabric" and LUMI's aws-ofi-rccl load.
OFI_NCCL_NAMES = frozenset({
    "OFI_NCCL_USE_IPV6_TCP", "OFI_NCCL_EXCLUDE_TCP_IF", "OFI_NCCL_GDR_FLUSH_DISABLE", "OFI_NCCL_DISABLE_DMABUF",
    "OFI_NCCL_NIC_DUP_CONNS", "OFI_NCCL_CUDA_FLUSH_ENABLE", "OFI_NCCL_CQ_READ_COUNT", "OFI_NCCL_PROTOCOL",
})

# RCCL: AMD's additions to the NCCL names (RCCL_PARAM names in RCCL's source, late 2025; ROCm 6.x docs).
RCCL_NAMES = frozenset({
    "RCCL_LOG_LEVEL", "RCCL_LOG_ROCTX", "RCCL_REPLAY_FILE", "RCCL_OVERRIDE_PROTO", "RCCL_OVERRIDE_ALGO",
    "RCCL_CHANNEL_TUNING_ENABLE", "RCCL_SOCKET_REUSEADDR", "RCCL_SOCKET_LINGER", "RCCL_NET_CONTIGUOUS_MEM",
    "RCCL_NET_HDP_FLUSH", "RCCL_ENABLE_INTRANET", "RCCL_INTRANET_THRESHOLD", "RCCL_TREES",
    "RCCL_DUMP_ROME_MODEL_FILE", "RCCL_MODEL_MATCHING_DISABLE", "RCCL_MODEL_REVERSAL_DISABLE",
    "RCCL_DISABLE_RAIL_TREES", "RCCL_OUTPUT_TREES", "RCCL_FORCE_ENABLE_GDRDMA",
    "RCCL_GDR_FLUSH_GPU_MEM_NO_RELAXED_ORDERING", "RCCL_P2P_NET_DISABLE", "RCCL_P2P_NET_THRESHOLD",
    "RCCL_P2P_BATCH_ENABLE", "RCCL_P2P_BATCH_THRESHOLD", "RCCL_STACK_SIZE_OVERRIDE", "RCCL_FORCE_ENABLE_DMABUF",
    "RCCL_MSCCL_ENABLE", "RCCL_MSCCL_FORCE_ENABLE", "RCCL_MSCCL_ENABLE_SINGLE_PROCESS",
    "RCCL_MSCCL_WORK_FIFO_DEPTH", "RCCL_MSCCL_FORCE_FULLOPS", "RCCL_MSCCLPP_ENABLE", "RCCL_MSCCLPP_FORCE_ENABLE",
    "RCCL_MSCCLPP_THRESHOLD", "RCCL_ENABLE_PROXY_TRACE", "RCCL_KERNEL_COLL_TRACE_ENABLE",
    "RCCL_KERNEL_COLL_TRACE_THREAD_ENABLE", "RCCL_ENABLE_CONTEXT_TRACKING", "RCCL_LATENCY_PROFILER",
    "RCCL_PIVOT_ALLTOALL_ENABLE", "RCCL_ALL_TO_ALL_PIVOT_ENABLE", "RCCL_LL128_FORCE_ENABLE",
    "RCCL_DIRECT_ALLGATHER_THRESHOLD", "RCCL_PIPELINE_ALL_DATA_TYPES", "RCCL_DISABLE_REDUCE_COPY_PIPELINING",
    "RCCL_INJECT_FAULTS", "RCCL_ENABLE_SIGNALHANDLER", "RCCL_ROCR_PATH", "RCCL_GFX9_CHEAP_FENCE_OFF",
    "RCCL_USE_ROCM_SMI_LIB",
})

# MIOPEN: MIOpen 2.x-3.x documentation (cache, find-db, logging). Its many debug switches all start
# with MIOPEN_DEBUG_ and are accepted as a group.
MIOPEN_NAMES = frozenset({
    "MIOPEN_USER_DB_PATH", "MIOPEN_CUSTOM_CACHE_DIR", "MIOPEN_DISABLE_CACHE",
    "MIOPEN_FIND_MODE", "MIOPEN_FIND_ENFORCE", "MIOPEN_ENABLE_LOGGING", "MIOPEN_ENABLE_LOGGING_CMD",
    "MIOPEN_ENABLE_LOGGING_MPMT", "MIOPEN_ENABLE_LOGGING_ELAPSED_TIME", "MIOPEN_LOG_LEVEL",
    "MIOPEN_COMPILE_PARALLEL_LEVEL",
})

# An old name that still works but has a current one (the library warns or may drop it).
RENAMED = {
    "NCCL_IB_GDR_LEVEL": "NCCL_NET_GDR_LEVEL",
    "NCCL_MAX_NRINGS": "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_NRINGS": "NCCL_MIN_NCHANNELS",
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
}


@dataclass(frozen=True)
class Family:
    """Variables sharing a prefix and read by one library."""

    prefix: str
    library: str  # in messages: "not an NCCL variable"
    article: str
    known: frozenset[str]
    open_prefixes: tuple[str, ...] = ()  # sub-families accepted without a name list


FAMILIES = (
    Family("TORCH_NCCL_", "PyTorch NCCL", "a", TORCH_NCCL_NAMES),
    Family("OFI_NCCL_", "AWS OFI NCCL plugin", "an", OFI_NCCL_NAMES),
    Family("NCCL_", "NCCL", "an", NCCL_NAMES),
    Family("RCCL_", "RCCL", "an", RCCL_NAMES),
    Family("FI_", "libfabric", "a", FI_NAMES),
    Family("MIOPEN_", "MIOpen", "a", MIOPEN_NAMES, open_prefixes=("MIOPEN_DEBUG_",)),
)


class EnvWarning(UserWarning):
    """A variable nodescale cannot vouch for, passed through unchanged."""


# ---------------------------------------------------------------------------------------------
# Values. Each rule returns None for a good value, else (rule broken, hint).

ValueRule = Callable[[str], "tuple[str, str] | None"]


def one_of(choices: tuple[str, ...], *, integers: bool = False, ignore_case: bool = False) -> ValueRule:
    """A value that must be one of ``choices`` (or, with ``integers``, a non-negative integer)."""
    listed = ", ".join(choices) + (" or an integer" if integers else "")

    def rule(value: str) -> tuple[str, str] | None:
        compared = value.upper() if ignore_case else value
        if compared in choices or (integers and value.isdigit()):
            return None
        if value.upper() in choices:
            return f"must be one of {listed}", f"values are case-sensitive: use {value.upper()}"
        # Guess only for words: "did you mean 0?" for a 2 would be noise.
        guess = closest(compared, choices, limit=1 if len(value) <= 4 else 2) if len(value) >= 3 else None
        return f"must be one of {listed}", f"did you mean {guess}?" if guess else f"use one of {listed}"

    return rule


_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]+$")


def interface_list(value: str) -> tuple[str, str] | None:
    """NCCL_SOCKET_IFNAME: comma-separated interface prefixes, optionally led by ^ (exclude) and = (exact)."""
    rule = "must be a comma-separated list of interface prefixes, optionally starting with ^ (exclude) or = (exact)"
    body = value[1:] if value.startswith("^") else value
    body = body[1:] if body.startswith("=") else body
    items = body.split(",")
    if any(not item for item in items):
        return rule, "remove the empty item (a stray or doubled comma)"
    for item in items:
        if item != item.strip():
            return rule, "remove the spaces: NCCL compares ' hsn1' with the interface names literally"
        if item[0] in "^=":
            return rule, f"only the whole list can start with ^ or =, not the item {item!r}"
        if not _IFNAME.match(item):
            return rule, f"{item!r} cannot be an interface name prefix"
    return None


_BOOL = one_of(("0", "1"))

# What NCCL and PyTorch accept, from the same documentation as the names above. NCCL compares
# GDR/P2P levels with strcmp (upper case only) but NCCL_DEBUG with strcasecmp.
VALUE_RULES: dict[str, ValueRule] = {
    "NCCL_NET_GDR_LEVEL": one_of(("LOC", "PIX", "PXB", "PHB", "SYS"), integers=True),
    "NCCL_IB_GDR_LEVEL": one_of(("LOC", "PIX", "PXB", "PHB", "SYS"), integers=True),
    "NCCL_P2P_LEVEL": one_of(("LOC", "NVL", "PIX", "PXB", "PHB", "SYS"), integers=True),
    "NCCL_DEBUG": one_of(("VERSION", "WARN", "INFO", "TRACE"), ignore_case=True),
    "NCCL_IB_DISABLE": _BOOL,
    "NCCL_P2P_DISABLE": _BOOL,
    "NCCL_SHM_DISABLE": _BOOL,
    "NCCL_CROSS_NIC": one_of(("0", "1", "2")),
    "NCCL_SOCKET_IFNAME": interface_list,
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": one_of(("0", "1", "2", "3")),
    "NCCL_ASYNC_ERROR_HANDLING": one_of(("0", "1", "2", "3")),
}


# ---------------------------------------------------------------------------------------------
# Names.

def family_of(name: str) -> Family | None:
    """The family whose prefix ``name`` starts with (case-sensitive, as the libraries read it)."""
    return next((family for family in FAMILIES if name.startswith(family.prefix)), None)


def is_known(name: str) -> bool:
    family = family_of(name)
    return family is not None and (name in family.known or name.startswith(family.open_prefixes))


def _distance(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) that turn ``a`` into ``b``."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b))
            if i > 1 and j > 1 and char_a == b[j - 2] and a[i - 2] == char_b:
                cost = min(cost, previous2[j - 2] + 1)
            current.append(cost)
        previous2, previous = previous, current
    return previous[-1]


def closest(value: str, choices: tuple[str, ...] | frozenset[str], limit: int) -> str | None:
    """The choice at most ``limit`` edits from ``value``, nearest first, then alphabetically."""
    scored = sorted((_distance(value, choice), choice) for choice in choices if abs(len(choice) - len(value)) <= limit)
    return scored[0][1] if scored and scored[0][0] <= limit else None


def near_miss(name: str, family: Family) -> str | None:
    """A known name ``name`` was probably meant to be: the same words reordered, or one typo away.

    One edit, not two: of the ~330 known names, two dozen are two edits from another real one
    (NCCL_MIN_/MAX_NCHANNELS, NCCL_P2P_/PXN_DISABLE), so a variable added by a later release
    would too often be taken for a typo; one edit away, only two known names collide.
    """
    words = sorted(name.split("_"))
    reordered = sorted(known for known in family.known if sorted(known.split("_")) == words)
    if reordered:
        return reordered[0]
    return closest(name, family.known, limit=1)


# ---------------------------------------------------------------------------------------------

def check_env(env: Mapping[str, str]) -> list[str]:
    """Check every NCCL/RCCL/libfabric/PyTorch-NCCL/MIOpen variable in ``env``.

    Raises :class:`UserError` for a misspelt name, a known name in the wrong case, or a bad
    value; returns one warning per unknown-but-plausible or renamed variable (in name order).
    Variables of other families (OMP_NUM_THREADS, MASTER_PORT, ...) are not looked at.
    """
    warnings: list[str] = []
    for name in sorted(env):
        value = str(env[name])
        upper = name.upper()
        if upper != name and is_known(upper):
            raise UserError(f"{name}={value}", f"environment variable names are case-sensitive; "
                            f"only {upper} is read", f"write {upper}={value}")
        family = family_of(name)
        if family is None:
            continue
        if not is_known(name):
            guess = near_miss(name, family)
            if guess:
                raise UserError(name, f"not {family.article} {family.library} variable; "
                                f"{family.library} would ignore it without a word", f"did you mean {guess}?")
            warnings.append(f"{name}: not {family.article} {family.library} variable nodescale knows; passed "
                            f"through unchanged (fine if it is new in your {family.library} version, "
                            "else check the spelling)")
            continue
        if name in RENAMED:
            warnings.append(f"{name}: old name of {RENAMED[name]}; still read for now, but use {RENAMED[name]}")
        rule = VALUE_RULES.get(name)
        problem = rule(value) if rule else None
        if problem:
            broken, hint = problem
            raise UserError(f"{name}={value}", broken, hint)
    return warnings
