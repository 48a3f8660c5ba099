"""One home per scheduler: ``local``, ``slurm`` and ``pbs`` (by name in ``table``), and the
local launcher's own modules (``local_launcher``, ``local_worker_group``, ``local_store_server``).

Nothing is imported here: training workers import the local launcher's module, and must not
pay for the job-script renderers.
"""
