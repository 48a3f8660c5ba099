"""Job scripts and submission for local runs, Slurm and PBS Pro (no torch imports)."""
