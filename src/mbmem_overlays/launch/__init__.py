"""The launch layer: the Hydra entry (train.py's body), Slurm rendering, and the GPU smoke-test harness."""
