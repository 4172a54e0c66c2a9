"""KV-cache transfer between prefill and decode groups: the plan, the interface, the backends."""

from kvtransfer import torch_dist  # noqa: F401  (registers gloo, gloo-async, nccl, nccl-async)
