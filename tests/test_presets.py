"""Cluster presets, the job arithmetic checked before submission, and the NCCL/libfabric variable check."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from nodescale.errors import UserError
from nodescale.launch.checks import check_job, walltime_seconds
from nodescale.launch.envcheck import FAMILIES, EnvWarning, check_env
from nodescale.launch.job_options import Software
from nodescale.launch.presets import builtin_presets, list_presets, load_preset
from nodescale.launch.spec import Container, JobSpec, Preset

BUILTINS = ["derecho", "generic-pbs", "generic-slurm", "hipergator", "lumi", "mahti", "puhti"]


@pytest.fixture(autouse=True)
def _no_user_presets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The developer's own ~/.config/nodescale/presets must not leak into these tests.
    monkeypatch.setenv("NODESCALE_PRESET_DIR", str(tmp_path / "no-user-presets"))


def job(**overrides: Any) -> JobSpec:
    fields: dict[str, Any] = dict(scheduler="slurm", preset="puhti", nodes=1, gpus_per_node=4, nproc_per_node=4,
                                  account="project_2001234", command=["python", "train.py"],
                                  workdir=Path("/work"), job_dir=Path("/work/jobs"))
    fields.update(overrides)
    return JobSpec(**fields)


def user_preset(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


def error_text(excinfo: pytest.ExceptionInfo[UserError]) -> str:
    return str(excinfo.value)


# ----------------------------------------------------------------------------------- built-ins

def test_the_seed_clusters_and_two_generic_presets_ship() -> None:
    assert builtin_presets() == BUILTINS
    assert list_presets() == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_preset_loads_and_its_env_is_clean(name: str) -> None:
    preset = load_preset(name)
    assert isinstance(preset, Preset) and preset.name == name
    assert preset.cpus_per_node >= preset.gpus_per_node  # at least one core per GPU process
    if preset.max_time:
        assert walltime_seconds(preset.max_time) > 0
    assert check_env(preset.env) == []  # no errors, and no unknown names either
    assert preset.container is None  # images are per project, never built in


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_preset_file_says_where_its_values_come_from(name: str) -> None:
    from importlib import resources

    text = resources.files("nodescale.launch").joinpath("presets", f"{name}.yaml").read_text()
    assert text.lstrip().startswith("#")


def test_preset_facts_from_the_cluster_docs() -> None:
    derecho, puhti, mahti, lumi = (load_preset(n) for n in ("derecho", "puhti", "mahti", "lumi"))
    assert (derecho.scheduler, derecho.gpus_per_node, derecho.cpus_per_node, derecho.gpu_request) == \
        ("pbs", 4, 64, "pbs-ngpus")
    assert derecho.env["NCCL_SOCKET_IFNAME"] == "hsn" and derecho.mpiexec == "pals" and derecho.cpu_bind == "none"
    assert (puhti.gpu_request, puhti.gpu_type, puhti.queue, puhti.account_required) == ("gres", "v100", "gpu", True)
    assert (mahti.gpu_type, mahti.cpus_per_node) == ("a100", 128)
    assert (lumi.gpus_per_node, lumi.cpus_per_node, lumi.queue) == (8, 56, "standard-g")
    assert lumi.env["NCCL_NET_GDR_LEVEL"] == "PHB" and lumi.env["NCCL_SOCKET_IFNAME"] == "hsn0,hsn1,hsn2,hsn3"
    # MIOpen's cache in a per-job directory: shell lines, since env values are written literally
    assert any("MIOPEN_USER_DB_PATH=" in line and "${SLURM_JOB_ID}" in line for line in lumi.setup)
    assert lumi.cpu_bind is not None and lumi.cpu_bind.count(",") == 7  # one mask per GCD


# ----------------------------------------------------------------------------------- user presets

def test_user_preset_overrides_the_builtin_of_the_same_name(tmp_path: Path) -> None:
    user_preset(tmp_path, "puhti", "scheduler: slurm\ngpus_per_node: 2\ncpus_per_node: 20\nqueue: gputest\n")
    preset = load_preset("puhti", user_dir=tmp_path)
    assert (preset.name, preset.gpus_per_node, preset.queue, preset.account_required) == ("puhti", 2, "gputest", False)


def test_user_preset_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user_preset(tmp_path / "mine", "mycluster", "scheduler: pbs\ngpus_per_node: 2\ncpus_per_node: 32\n")
    monkeypatch.setenv("NODESCALE_PRESET_DIR", str(tmp_path / "mine"))
    assert "mycluster" in list_presets()
    assert load_preset("mycluster").scheduler == "pbs"


def test_user_preset_extends_a_builtin_to_add_a_container(tmp_path: Path) -> None:
    # The example in lumi.yaml's comment, as a user would write it.
    user_preset(tmp_path, "lumi", "extends: lumi\n"
                                  "setup:\n  - module use /appl/local/laifs/modules\n"
                                  "  - module load lumi-aif-singularity-bindings\n"
                                  "env:\n  NCCL_DEBUG: INFO\n"
                                  "queue: small-g\n"
                                  "container:\n  image: /project/project_465000001/pytorch.sif\n")
    builtin, preset = load_preset("lumi"), load_preset("lumi", user_dir=tmp_path)
    assert preset.container is not None and preset.container.runtime == "singularity"
    assert preset.setup == [*builtin.setup, "module use /appl/local/laifs/modules",
                            "module load lumi-aif-singularity-bindings"]  # lists appended
    assert preset.env == {**builtin.env, "NCCL_DEBUG": "INFO"}  # env merged
    assert preset.queue == "small-g" and preset.name == "lumi"  # anything else replaced
    assert preset.gpus_per_node == 8 and preset.cpu_bind == builtin.cpu_bind


@pytest.mark.parametrize("text, expected", [
    ("scheduler: slurm\ngpus_per_node: [4\n", ["lumi.yaml", "is not valid YAML at line"]),
    ("- just\n- a list\n", ["lumi.yaml", "must be a mapping"]),
    ("scheduler: slurm\ngpu_per_node: 4\ncpus_per_node: 8\n", ["key 'gpu_per_node'", "not a preset key",
                                                               "did you mean 'gpus_per_node'?"]),
    ("scheduler: slurm\ngpus_per_node: -1\ncpus_per_node: 8\n", ["key 'gpus_per_node' = -1", "greater than or equal"]),
    ("scheduler: sge\ngpus_per_node: 1\ncpus_per_node: 8\n", ["key 'scheduler'", "'slurm' or 'pbs'"]),
    ("gpus_per_node: 1\ncpus_per_node: 8\n", ["key 'scheduler'", "is required"]),
    ("name: other\nscheduler: slurm\ngpus_per_node: 1\ncpus_per_node: 8\n", ["differs from the file's name"]),
    ("scheduler: slurm\ngpus_per_node: 1\ncpus_per_node: 8\nmax_time: 3 days\n", ["key 'max_time'", "HH:MM:SS"]),
    ("extends: lumy\n", ["key 'extends'", "did you mean 'lumi'?"]),
    ("extends: lumi\nenv:\n  NCCL_DISABLE_IB: '1'\n", ["key 'env': NCCL_DISABLE_IB", "NCCL_IB_DISABLE"]),
])
def test_invalid_user_preset_names_file_key_and_rule(tmp_path: Path, text: str, expected: list[str]) -> None:
    user_preset(tmp_path, "lumi", text)
    with pytest.raises(UserError) as excinfo:
        load_preset("lumi", user_dir=tmp_path)
    for part in expected:
        assert part in error_text(excinfo)


def test_unknown_preset_suggests_the_nearest() -> None:
    with pytest.raises(UserError, match="did you mean 'puhti'"):
        load_preset("puhtti")
    with pytest.raises(UserError, match="known presets"):
        load_preset("../etc/passwd")


# ----------------------------------------------------------------------------------- check_job

def test_a_sensible_job_passes_every_check_quietly() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_job(job(), load_preset("puhti"))
        check_job(job(scheduler="pbs", preset="derecho", nodes=2, account="UABC0001", time="12:00:00"),
                  load_preset("derecho"))
        check_job(job(preset="lumi", gpus_per_node=8, nproc_per_node=8, mode="per-gpu", account="project_465000001",
                      software=Software(container="/appl/local/laifs/containers/torch.sif")), load_preset("lumi"))
        check_job(job(preset="generic-slurm", gpus_per_node=0, nproc_per_node=16, account=None),
                  load_preset("generic-slurm"))
        check_job(job(scheduler="local", mode="spawn"), load_preset("puhti"))


def test_a_container_cluster_warns_about_a_job_without_one() -> None:
    """LUMI's PyTorch exists only in containers: a job with none would find no torch, and is warned about."""
    lumi_job = job(preset="lumi", gpus_per_node=8, nproc_per_node=8, account="project_465000001")
    with pytest.warns(UserWarning, match="lumi has PyTorch only inside containers .* Add --container IMAGE.sif"):
        check_job(lumi_job, load_preset("lumi"))
    with_own = load_preset("lumi").model_copy(update={"container": Container(image="/project/mine.sif")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_job(lumi_job, with_own)  # a user preset's container is one
        check_job(job(), load_preset("puhti"))  # modules give puhti its PyTorch


@pytest.mark.parametrize("spec, cluster, expected", [
    (dict(scheduler="pbs", gpus_per_node=8, nproc_per_node=8), "derecho",
     ["--gpus-per-node 8: derecho nodes have 4 GPUs", "--nodes 2 --gpus-per-node 4"]),
    (dict(gpus_per_node=4, nproc_per_node=8), "puhti",
     ["--nproc-per-node 8 --gpus-per-node 4", "8 / 4 = 2 per GPU", "--nproc-per-node 4"]),
    (dict(gpus_per_node=4, nproc_per_node=2, mode="per-gpu"), "puhti",
     ["per-gpu mode starts one task per GPU: 2 processes != 4 GPUs"]),
    (dict(gpus_per_node=0, nproc_per_node=32, account=None), "generic-slurm",
     ["generic-slurm nodes have 16 cores: 16 // 32 = 0 cores per process"]),
    (dict(nodes=2, mode="spawn"), "puhti", ["--mode spawn --nodes 2", "one node only"]),
    (dict(account=None), "puhti", ["puhti rejects jobs without --account", "hint: --account project_XXXX"]),
    (dict(time="4-00:00:00"), "puhti", ["--time 4-00:00:00: puhti's gpu queue allows at most 3-00:00:00",
                                        "96 h > 72 h"]),
    (dict(scheduler="pbs"), "puhti", ["--scheduler pbs --cluster puhti", "puhti runs slurm, not pbs",
                                      "--scheduler slurm"]),
])
def test_each_rule_shows_its_arithmetic(spec: dict[str, Any], cluster: str, expected: list[str]) -> None:
    with pytest.raises(UserError) as excinfo:
        check_job(job(preset=cluster, **spec), load_preset(cluster))
    for part in expected:
        assert part in error_text(excinfo)


def test_time_limit_applies_only_to_the_presets_own_queue() -> None:
    check_job(job(time="14-00:00:00", queue="longrun", gpus_per_node=0, nproc_per_node=1), load_preset("puhti"))


def test_merged_env_is_checked_and_the_jobs_value_wins() -> None:
    with pytest.raises(UserError, match="NCCL_NET_GDR_LEVEL=PBH"):
        check_job(job(preset="lumi", gpus_per_node=8, nproc_per_node=8, env={"NCCL_NET_GDR_LEVEL": "PBH"}),
                  load_preset("lumi"))
    with pytest.warns(EnvWarning, match="NCCL_SOMETHING_NEW"):
        check_job(job(env={"NCCL_SOMETHING_NEW": "1"}), load_preset("puhti"))


# ----------------------------------------------------------------------------------- envcheck

@pytest.mark.parametrize("env, expected", [
    ({"NCCL_DISABLE_IB": "1"}, "NCCL_DISABLE_IB: not an NCCL variable"),
    ({"NCCL_DISABLE_IB": "1"}, "hint: did you mean NCCL_IB_DISABLE?"),
    ({"NCCL_SOCKET_IFNAM": "hsn"}, "did you mean NCCL_SOCKET_IFNAME?"),
    ({"FI_CXI_DISABLE_HOST_REGISTR": "1"}, "not a libfabric variable"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLNG": "1"}, "did you mean TORCH_NCCL_ASYNC_ERROR_HANDLING?"),
    ({"MIOPEN_USER_DB_PAHT": "/tmp/x"}, "did you mean MIOPEN_USER_DB_PATH?"),
    ({"nccl_ib_disable": "1"}, "case-sensitive; only NCCL_IB_DISABLE is read"),
    ({"NCCL_NET_GDR_LEVEL": "PBH"}, "must be one of LOC, PIX, PXB, PHB, SYS or an integer"),
    ({"NCCL_NET_GDR_LEVEL": "PBH"}, "did you mean PHB?"),
    ({"NCCL_NET_GDR_LEVEL": "phb"}, "case-sensitive: use PHB"),
    ({"NCCL_DEBUG": "VERBOSE"}, "must be one of VERSION, WARN, INFO, TRACE"),
    ({"NCCL_IB_DISABLE": "true"}, "must be one of 0, 1"),
    ({"NCCL_P2P_DISABLE": "yes"}, "must be one of 0, 1"),
    ({"NCCL_SHM_DISABLE": "2"}, "must be one of 0, 1"),
    ({"NCCL_CROSS_NIC": "3"}, "must be one of 0, 1, 2"),
    ({"NCCL_SOCKET_IFNAME": "hsn0, hsn1"}, "remove the spaces"),
    ({"NCCL_SOCKET_IFNAME": "hsn0,,hsn1"}, "empty item"),
    ({"NCCL_SOCKET_IFNAME": "=hsn0,=hsn1"}, "only the whole list can start with ^ or ="),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "4"}, "must be one of 0, 1, 2, 3"),
])
def test_envcheck_errors(env: dict[str, str], expected: str) -> None:
    with pytest.raises(UserError) as excinfo:
        check_env(env)
    assert expected in error_text(excinfo)


def test_seed_derecho_script_env_is_caught() -> None:
    # The environment block of the Derecho seed's job script, verbatim.
    seed = {"NCCL_SOCKET_IFNAME": "hsn", "MPICH_GPU_MANAGED_MEMORY_SUPPORT_ENABLED": "1",
            "MPICH_OFI_NIC_POLICY": "GPU", "MPICH_GPU_SUPPORT_ENABLED": "1", "NCCL_IB_DISABLE": "1",
            "NCCL_CROSS_NIC": "1", "NCCL_NCHANNELS_PER_NET_PEER": "4", "MPICH_RDMA_ENABLED_CUDA": "1",
            "NCCL_NET": "AWS Libfabric", "NCCL_NET_GDR_LEVEL": "PBH", "FI_CXI_DISABLE_HOST_REGISTER": "1",
            "FI_CXI_OPTIMIZED_MRS": "false", "FI_MR_CACHE_MONITOR": "userfaultfd"}
    with pytest.raises(UserError, match="did you mean PHB"):
        check_env(seed)
    assert check_env({**seed, "NCCL_NET_GDR_LEVEL": "PHB"}) == []


def test_unknown_names_far_from_known_ones_warn_and_pass() -> None:
    found = check_env({"NCCL_SOMETHING_FROM_2030": "1", "FI_EFA_USE_DEVICE_RDMA": "1", "RCCL_NEW_KNOB": "1"})
    assert len(found) == 3
    assert found[0].startswith("FI_EFA_USE_DEVICE_RDMA: not a libfabric variable nodescale knows")
    assert "passed through unchanged" in found[1]


def test_renamed_variables_warn_with_the_current_name() -> None:
    (warning,) = check_env({"NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert "use TORCH_NCCL_ASYNC_ERROR_HANDLING" in warning


@pytest.mark.parametrize("env", [
    {},
    {"NCCL_DEBUG": "info", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_NET_GDR_LEVEL": "3"},
    {"NCCL_SOCKET_IFNAME": "^docker,lo", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_CROSS_NIC": "2"},
    {"NCCL_SOCKET_IFNAME": "^=docker0", "NCCL_P2P_LEVEL": "NVL", "NCCL_SHM_DISABLE": "0"},
    {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_HIGH_PRIORITY": "1"},
    {"FI_PROVIDER": "cxi", "FI_MR_CACHE_MONITOR": "kdreg2", "FI_CXI_RX_MATCH_MODE": "hybrid"},
    {"MIOPEN_DISABLE_CACHE": "1", "MIOPEN_DEBUG_CONV_GEMM": "0", "MIOPEN_CUSTOM_CACHE_DIR": "/tmp/m"},
    {"OMP_NUM_THREADS": "7", "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": "0,1"},  # not ours to judge
])
def test_valid_configurations_pass_silently(env: dict[str, str]) -> None:
    assert check_env(env) == []


def test_known_name_lists_are_well_formed() -> None:
    for family in FAMILIES:
        assert family.known, family.prefix
        assert all(name.startswith(family.prefix) and name == name.upper() for name in family.known), family.prefix
