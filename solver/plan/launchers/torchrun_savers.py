"""The memory savers of the generated torchrun script that come from torchtune (issue 14): its chunked
cross-entropy (`CEWithChunkedOutputLoss` with the head run per chunk) and its activation offloading
(`OffloadActivations` saved-tensor hooks), written anew in plain PyTorch (torchtune is not a dependency), so that a
plan fitplan priced with them runs as priced.

Their code is the template part templates/memory_savers.py of train_fitplan.py (which imports nothing from fitplan);
`SAVER_VALUES` are the constants it is priced with, filled into it so the script and the cost model cannot drift
apart."""

from __future__ import annotations

from costmodels.activation_offload import MIN_OFFLOAD_BYTES
from costmodels.loss import TORCHTUNE_CHUNKS

# torchtune 0.6.1 training/_activation_offloading.py `OffloadActivations(max_fwd_stash_size=5)`: the forward keeps
# the last five offloaded tensors on the device until their copies are done.
FORWARD_STASH = 5

SAVER_VALUES = {"CHUNKS": repr(TORCHTUNE_CHUNKS), "MIN_OFFLOAD_BYTES": repr(MIN_OFFLOAD_BYTES),
                "FORWARD_STASH": repr(FORWARD_STASH)}
