"""`costmodels.check` says why a configuration cannot be priced on a graph, naming the real cause."""

from __future__ import annotations

import pytest

from costmodels import Config, Engine, InvalidConfig, Workload, estimate, parse_cluster
from graphs import Checkpoint, lower


def test_a_mode_the_lowering_lacks_names_what_lowering_would_have_it():
    graph = lower("gpt2")  # traced without op-level SAC
    layers = len(graph.decoder_layers())
    config = Config(engine=Engine.FSDP2, zero=3, micro_batch=2, checkpoint=(Checkpoint.OP_SELECTIVE,) * layers)
    with pytest.raises(InvalidConfig, match=r"lowered without op-level SAC \(lower\(\.\.\., op_selective=True\)\)"):
        estimate(graph, parse_cluster("1xA100"), Workload(seq_len=512, global_batch=2), config)
