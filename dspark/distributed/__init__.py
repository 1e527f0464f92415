"""Data parallelism: engine replicas as one torch.distributed group (see data_parallel.py)."""
