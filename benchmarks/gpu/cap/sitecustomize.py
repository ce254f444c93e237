"""Loaded by Python at start-up when this folder is on PYTHONPATH: in a torchrun worker (LOCAL_RANK set), caps the
caching allocator at FITPLAN_CAP_BYTES of device memory, so a run shows whether a plan fits in what its estimate
says it needs (torch.cuda.set_per_process_memory_fraction)."""

import os

if os.environ.get("LOCAL_RANK") is not None and os.environ.get("FITPLAN_CAP_BYTES"):
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, int(os.environ["FITPLAN_CAP_BYTES"]) / total), 0)
