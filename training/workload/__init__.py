"""The workload contract: what a user brings (training/workload/contract.py) and how the platform runs it."""
