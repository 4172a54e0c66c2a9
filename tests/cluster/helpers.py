"""What the cluster tests share beside their fixtures (tests/cluster/conftest.py)."""

# Every test cluster's --max-model-len: short, so that the CPU's KV pools stay small.
MAX_MODEL_LEN = 512
