"""One home per scheduler (local, Slurm, PBS Pro), and the local launcher's own processes."""
