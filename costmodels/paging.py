"""Paged optimizers: bitsandbytes' `PagedAdamW8bit` / `PagedAdamW32bit` keep their large states in CUDA unified
memory, which the driver pages out to host RAM under device-memory pressure and back in when the step needs them.

The states are the non-paged optimizers' (`optimizers.state_bytes`); only where they live differs. bitsandbytes
0.50.2 `Optimizer8bit.get_state_buffer` (bitsandbytes/optim/optimizer.py) allocates `state1`/`state2` with
`F.get_paged` (cudaMallocManaged) only for tensors of at least 1e5 elements; smaller tensors' states, the 8-bit
absmax blocks and the quantisation maps are ordinary device tensors. `Optimizer8bit.step` prefetches one
tensor's states (`prefetch_state`: `cuMemPrefetchAsync` to the device), updates it and moves on, so under
pressure at most one tensor's paged states must be resident at a time. The QLoRA paper (Dettmers et al. 2023,
section 3, "Paged Optimizers") describes the same mechanism.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from .cluster import Cluster
from .offload import host_link
from .optimizers import PAGED_OPTIMIZERS, fixed_state_bytes, state_bytes
from .terms import ModelStates

# bitsandbytes 0.50.2 `get_state_buffer`: `if not self.is_paged or p.numel() < 1e5: return torch.zeros_like(...)`.
BNB_PAGED_MIN_NUMEL = 100_000
# The 8-bit states (`state1`, `state2`) are uint8 shaped like the parameter; the 32-bit ones fp32.
_PAGED_ITEMSIZE = {PAGED_OPTIMIZERS[0]: 1, PAGED_OPTIMIZERS[1]: 4}
# Per step, each paged block is prefetched to the device and, to make room for the next, evicted back: the
# CUDA driver API (`cuMemPrefetchAsync`: "the Unified Memory driver may evict pages from other
# cuMemAllocManaged allocations to host memory in order to make room") moves the bytes both ways.
PAGING_TRIPS_PER_STEP = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedStates:
    """Optimizer-state bytes of one rank under a paged optimizer, by where they live."""

    resident: int
    """Ordinary device tensors: states of tensors under 1e5 elements, 8-bit absmax blocks, quantisation maps."""
    paged: int
    """Bytes in unified memory (host RAM when paged out)."""
    largest_block: int
    """The largest one tensor's paged states: what must be on the device while that tensor steps."""

    @property
    def device(self) -> int:
        """Device bytes during the step when everything else is paged out."""
        return self.resident + self.largest_block


def is_paged(optimizer: object) -> bool:
    return str(optimizer) in PAGED_OPTIMIZERS


def paged_block_bytes(optimizer: str, shape: tuple[int, ...]) -> int:
    """Bytes of one tensor's states that bitsandbytes allocates in unified memory."""
    numel = math.prod(shape)
    return 0 if numel < BNB_PAGED_MIN_NUMEL else 2 * numel * _PAGED_ITEMSIZE[optimizer]


def paged_states(optimizer: str, shapes: Iterable[tuple[tuple[int, ...], int]], *, instances: int = 1) -> PagedStates:
    """Split the states of local tensors (`(shape, count)` pairs) into device-resident and paged bytes.

    `instances` is the number of optimizer objects (one per parameter under optimizer-in-backward), each with
    its own quantisation maps.
    """
    if not is_paged(optimizer):
        raise ValueError(f"optimizer={optimizer!r} is not paged; paged ones are {', '.join(PAGED_OPTIMIZERS)}")
    total = paged = largest = 0
    for shape, count in shapes:
        block = paged_block_bytes(optimizer, shape)
        total += count * state_bytes(optimizer, shape, 4)
        paged += count * block
        largest = max(largest, block if count else 0)
    resident = total - paged + instances * fixed_state_bytes(optimizer)
    return PagedStates(resident=resident, paged=paged, largest_block=largest)


def paged_model_states(states: ModelStates, paged: PagedStates) -> ModelStates:
    """`states` with the optimizer states a paged optimizer leaves on the device; the paged bytes live in host
    RAM (they count against the node's memory, as offloaded states do)."""
    return replace(states, optimizer=paged.device, step_temp=0, cpu=states.cpu + paged.paged)


def paging_seconds(cluster: Cluster, paged: PagedStates | None) -> float:
    """Seconds per step of moving the paged states in and out over the host link (assumes every block pages,
    which is what excluding them from the device peak implies); 0 without a paged optimizer (None)."""
    if paged is None:
        return 0.0
    return PAGING_TRIPS_PER_STEP * paged.paged / host_link(cluster)
