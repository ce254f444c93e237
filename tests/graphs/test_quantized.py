"""QLoRA, DoRA, modules_to_save and rslora lowerings against real PEFT and bitsandbytes runs on CPU.

The reference is a real model: transformers' `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`
of a tiny checkpoint, wrapped by PEFT's `get_peft_model`, run forward and backward on CPU tensors, with torch's
`saved_tensors_hooks` attributing saved storages to the decoder layer that saved them.
"""

from __future__ import annotations

import copy
import weakref
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from costmodels.quantization import dequantize_bytes_moved, dequantized_weight_bytes
from graphs import Checkpoint, LoraSpec, Quantization, UnsupportedModel, lower
from graphs.quantization import bnb_config
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.slow

B, S = 2, 24


@pytest.fixture(scope="module")
def values():
    return tiny_values("llama")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, values):
    return write_config(tmp_path_factory.mktemp("config"), values)


def _save_checkpoint(path, values):
    """A tiny random bf16 checkpoint that transformers can load quantized."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, values):
    return _save_checkpoint(tmp_path_factory.mktemp("checkpoint"), values)


def _real_model(checkpoint, spec: LoraSpec, *, fp32_adapters: bool = False):
    """The model as transformers, bitsandbytes and PEFT build it; `fp32_adapters`: PEFT's default (what runs under
    autocast), else the adapters in the base's bf16 (what engines that cast the module run)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    quantized = {} if spec.quantization is None else {
        "quantization_config": bnb_config(spec.quantization, double_quant=spec.double_quant, compute_dtype="bfloat16")}
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cpu", **quantized)
    model.train()
    return get_peft_model(model, spec.peft_config(), autocast_adapter_dtype=fp32_adapters)


def _state_tensors(state) -> list[torch.Tensor]:
    found = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    return found + (_state_tensors(state.state2) if state.state2 is not None else [])


def _device_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters as they sit in memory, with bitsandbytes' quantisation state."""
    total = 0
    for param in module.parameters():
        total += param.untyped_storage().nbytes()
        if getattr(param, "quant_state", None) is not None:
            total += sum(t.untyped_storage().nbytes() for t in _state_tensors(param.quant_state))
    return total


def _decoder_layers(peft_model) -> torch.nn.ModuleList:
    inner = peft_model.base_model.model
    return inner.model.layers if hasattr(inner, "model") else inner.transformer.h  # Llama-style, GPT-2


def _saved_per_layer(peft_model, ids, *, autocast: bool = False) -> list[int]:
    """Saved-for-backward bytes per decoder layer of one real training step (storages saved by one layer only)."""
    layers = _decoder_layers(peft_model)
    current: list[int | None] = [None]
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    params = {p.untyped_storage().data_ptr() for p in peft_model.parameters()}
    saves: list[tuple[weakref.ref, int]] = []  # (storage, layer) for every save made inside a layer

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if current[0] is not None and storage.data_ptr() not in params:
            saves.append((weakref.ref(storage), current[0]))
        return tensor

    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)):
        loss = peft_model(input_ids=ids, labels=ids).loss
    for handle in handles:
        handle.remove()
    # What autograd still holds once forward is done: a graph forward discards (DoRA's LoRA product, built from
    # an identity and used detached) frees its saves at once.
    savers: dict[int, set[int]] = defaultdict(set)
    sizes: dict[int, int] = {}
    for ref, layer in saves:
        if (storage := ref()) is not None:
            savers[storage.data_ptr()].add(layer)
            sizes[storage.data_ptr()] = storage.nbytes()
    loss.backward()
    return [sum(sizes[k] for k, who in savers.items() if who == {i}) for i in range(len(layers))]


QLORA = LoraSpec(rank=8, alpha=16, quantization="nf4", double_quant=True)


@pytest.fixture(scope="module")
def qlora_graph(folder):
    return lower(str(folder), lora=QLORA, use_cache=False)


def test_qlora_parameters_equal_transformers_bitsandbytes_and_peft(qlora_graph, checkpoint):
    real = _real_model(checkpoint, QLORA)
    trainable, total = real.get_nb_trainable_parameters()
    assert (qlora_graph.trainable_count, qlora_graph.param_count) == (trainable, total)
    layers = real.base_model.model.model.layers
    for i in range(len(layers)):
        node = qlora_graph.node(f"layers.{i}")
        assert sum(p.stored_bytes or p.numel * p.itemsize for p in node.params) == _device_bytes(layers[i])
        assert all(p.quantized == (not p.trainable and p.name.endswith(".weight") and "layernorm" not in p.name)
                   for p in node.params)
    # Embedding, final norm and LM head stay in bf16 (transformers' skip list); the whole model matches too.
    graph_bytes = sum(p.stored_bytes or p.numel * p.itemsize for p in qlora_graph.params())
    assert graph_bytes == _device_bytes(real)
    assert not any(p.quantized for p in qlora_graph.node("head").params)


def test_qlora_with_biases_equals_real_bitsandbytes(tmp_path):
    # Qwen2's q/k/v projections have biases, which Linear4bit keeps in the model's dtype beside the packed weight.
    values = tiny_values("qwen2")
    spec = LoraSpec(rank=8, alpha=16, quantization="nf4", targets=("q_proj", "v_proj"))
    graph = lower(str(write_config(tmp_path / "config", values)), lora=spec, use_cache=False)
    real = _real_model(_save_checkpoint(tmp_path / "checkpoint", values), spec)
    assert (graph.trainable_count, graph.param_count) == real.get_nb_trainable_parameters()
    layer = real.base_model.model.model.layers[1]
    assert sum(p.stored_bytes or p.numel * p.itemsize for p in graph.node("layers.1").params) == _device_bytes(layer)
    torch.manual_seed(1)
    saved = _saved_per_layer(real, torch.randint(0, 512, (B, S)))
    assert graph.node("layers.1").cost().saved(B, S) == saved[1]


def test_qlora_saved_activations_equal_a_real_step(qlora_graph, checkpoint):
    real = _real_model(checkpoint, QLORA)
    torch.manual_seed(1)
    saved = _saved_per_layer(real, torch.randint(0, 512, (B, S)))
    assert qlora_graph.node("layers.1").cost().saved(B, S) == saved[1]


def test_qlora_under_autocast_equals_a_real_step(folder, checkpoint, monkeypatch):
    # HF Trainer with bf16=True runs the 4-bit model under autocast (what fitplan lowers for plain PyTorch), with
    # PEFT's default fp32 adapters. PEFT's 4-bit adapters skip their input and output casts when
    # `torch.is_autocast_enabled()` (CUDA's autocast) is on, as it is on the GPU: the CPU run stands in for it.
    graph = lower(str(folder), lora=QLORA, autocast="bfloat16", use_cache=False)
    assert {p.itemsize for p in graph.params() if p.trainable} == {4}
    real = _real_model(checkpoint, QLORA, fp32_adapters=True)
    original = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: original(*(args or ("cpu",))))
    torch.manual_seed(1)
    saved = _saved_per_layer(real, torch.randint(0, 512, (B, S)), autocast=True)
    assert graph.node("layers.1").cost().saved(B, S) == saved[1]


# axolotl 0.19's loader: PEFT's preparation, then modules named like norms and its embedding modules cast back
# (solver.plan.launchers.axolotl.kbit_preparation).
AXOLOTL_RECAST = ("norm", "embed_tokens", "lm_head")


def _prepared_model(checkpoint, spec: LoraSpec, recast: tuple[str, ...]):
    """A 4-bit base loaded by transformers and bitsandbytes, prepared by PEFT's own `prepare_model_for_kbit_training`
    (as the QLoRA paper's script and axolotl call it, before the adapters), the modules named in `recast` cast back
    to bf16 (`module.to`, as axolotl does), then PEFT's fp32 adapters (its default, which runs under autocast)."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cpu",
                                                 quantization_config=bnb_config(spec.quantization,
                                                                                double_quant=spec.double_quant,
                                                                                compute_dtype="bfloat16"))
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for name, module in model.named_modules():
        if any(part in name for part in recast):
            module.to(torch.bfloat16)
    model.train()
    return get_peft_model(model, spec.peft_config())


@pytest.mark.parametrize(("arch", "recast"), [("llama", ()), ("gpt2", ()), ("gpt2", AXOLOTL_RECAST)],
                         ids=["llama-peft", "gpt2-peft", "gpt2-axolotl"])
def test_kbit_prepared_lowering_equals_peft_prepare_model_for_kbit_training(arch, recast, tmp_path, monkeypatch):
    # PEFT's preparation leaves every 16-bit parameter outside the 4-bit layers in fp32 (embeddings, LM head,
    # norms): their bytes double and the fp32 norm outputs feeding the 4-bit layers are saved wider. axolotl casts
    # modules named like norms and its embedding modules back, which leaves GPT-2's ln_1/ln_2/ln_f and wte/wpe fp32.
    # Checked at a step after the first under bf16 autocast (bitsandbytes casts a 4-bit layer's bias to the compute
    # dtype in its first forward, for good), as the DDP bf16-mixed run axolotl starts is lowered.
    from costmodels.config import Config, Engine, Precision
    from costmodels.states import model_states

    values = tiny_values(arch)
    graph = lower(str(write_config(tmp_path / "config", values)), lora=QLORA, autocast="bfloat16", kbit=recast,
                  use_cache=False)
    plain = lower(str(write_config(tmp_path / "config", values)), lora=QLORA, autocast="bfloat16", use_cache=False)
    real = _prepared_model(_save_checkpoint(tmp_path / "checkpoint", values), QLORA, recast)
    original = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: original(*(args or ("cpu",))))
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (B, S))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the first forward recasts the 4-bit biases
        real(input_ids=ids)  # (a storage it frees would otherwise be taken for a parameter's by `_saved_per_layer`)
    saved = _saved_per_layer(real, ids, autocast=True)
    assert graph.node("layers.1").cost().saved(B, S) == saved[1] > plain.node("layers.1").cost().saved(B, S)
    assert sum(p.stored_bytes or p.numel * p.itemsize for p in graph.params()) == _device_bytes(real)
    assert _device_bytes(real) > sum(p.stored_bytes or p.numel * p.itemsize for p in plain.params())
    # The engine keeps them as prepared: the fp32 adapters, the packed weights, the upcast frozen tensors.
    config = Config(precision=Precision.BF16_MIXED, engine=Engine.DDP)
    assert model_states(graph, config).params == _device_bytes(real)


def test_axolotl_recast_undoes_the_preparation_of_a_llama(folder):
    # Every 16-bit parameter of a Llama sits in a norm or an embedding module: axolotl's cast back restores the
    # unprepared lowering, cost for cost.
    plain = lower(str(folder), lora=QLORA, autocast="bfloat16", use_cache=False).to_json()
    recast = lower(str(folder), lora=QLORA, autocast="bfloat16", kbit=AXOLOTL_RECAST, use_cache=False).to_json()
    assert recast == plain


def test_qlora_peaks_hold_one_dequantized_weight(qlora_graph, values):
    # bitsandbytes dequantizes the whole weight to bf16 for each matmul (forward above 1536 tokens on CUDA, and
    # backward): at a single token that transient sets the layer's peaks.
    largest = dequantized_weight_bytes((values["intermediate_size"], values["hidden_size"]), 2)
    cost = qlora_graph.node("layers.1").cost()
    for peak in (cost.fwd_peak, cost.bwd_peak):
        at_one_token = max(candidate(1, 1) for candidate in peak.candidates)
        assert largest <= at_one_token < largest + 16 * 1024


def test_qlora_time_includes_each_dequantization(qlora_graph, folder):
    # Against 16-bit LoRA, a QLoRA layer's memory-bound traffic (priced at HBM bandwidth by costmodels.compute)
    # grows by one dequantization per quantized linear in forward and in backward, as costmodels.quantization
    # counts it, plus PEFT's defensive clone of each 4-bit output in forward (peft lora/bnb.py `result.clone()`).
    lora = lower(str(folder), lora=replace(QLORA, quantization=None, double_quant=False), use_cache=False)
    shapes = [p.shape for p in qlora_graph.node("layers.1").params if p.quantized]
    dequantize = sum(dequantize_bytes_moved(shape, Quantization.NF4, double_quant=True, compute_itemsize=2)
                     for shape in shapes)
    clone = sum(2 * B * S * shape[0] * 2 for shape in shapes)
    quantized, plain = qlora_graph.node("layers.1").cost(), lora.node("layers.1").cost()
    assert quantized.forward.io_bytes(B, S) - plain.forward.io_bytes(B, S) == dequantize + clone
    assert quantized.backward.io_bytes(B, S) - plain.backward.io_bytes(B, S) == dequantize
    assert quantized.forward.flops(B, S) == plain.forward.flops(B, S)
    assert quantized.backward.flops(B, S) == plain.backward.flops(B, S)


@pytest.mark.parametrize(("engine", "dp", "zero"), [("ddp", 1, 0), ("fsdp2", 2, 3)])
def test_model_states_hold_the_packed_base_weights(qlora_graph, engine, dp, zero):
    from costmodels.config import Config, Engine, Precision
    from costmodels.states import model_states

    config = Config(precision=Precision.BF16, engine=Engine(engine), dp=dp, zero=zero)
    packed = sum(p.stored_bytes for p in qlora_graph.params() if p.quantized)
    rest = sum(p.numel * 2 for p in qlora_graph.params() if not p.quantized)
    # Quantized weights stay whole on every rank; the rest (bf16 under pure bf16) shards over dp under FSDP2
    # (each tensor's shard rounded up to whole rows).
    params = model_states(qlora_graph, config).params
    if dp == 1:
        assert params == packed + rest
    else:
        assert packed + rest // dp <= params <= packed + rest // dp + 2 * 128 * len(qlora_graph.params())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gpt2", "falcon"])
def test_quantized_weights_are_those_transformers_and_bitsandbytes_quantize(arch, tmp_path):
    # transformers' from_pretrained(quantization_config=...) swaps exact nn.Linear (and GPT-2's Conv1D) layers
    # only: Falcon's FalconLinear subclass stays 16-bit with a log line. The lowering quantizes the same weights,
    # and refuses a model where the real load quantizes none.
    values = tiny_values(arch)
    real = _real_model(_save_checkpoint(tmp_path / "checkpoint", values), QLORA).base_model.model
    quantized = {f"{name}.weight" for name, module in real.named_modules() if isinstance(module, bnb.nn.Linear4bit)}
    folder = str(write_config(tmp_path / "config", values))
    if not quantized:
        with pytest.raises(UnsupportedModel, match=r"exactly torch\.nn\.Linear"):
            lower(folder, lora=QLORA, use_cache=False)
        return
    graph = lower(folder, lora=QLORA, use_cache=False)
    assert {p.name for p in graph.params() if p.quantized} == quantized


def test_int8_bases_are_refused_by_the_lowering(folder):
    with pytest.raises(UnsupportedModel, match="int8"):
        lower(str(folder), lora=LoraSpec(quantization="int8"), use_cache=False)


DORA = LoraSpec(rank=8, alpha=16, use_dora=True)


@pytest.mark.parametrize("spec", [DORA, LoraSpec(rank=8, alpha=16, use_dora=True, quantization="fp4")],
                         ids=["dora", "qdora"])
def test_dora_parameters_and_saved_activations_equal_peft(folder, checkpoint, values, spec):
    graph = lower(str(folder), lora=spec, use_cache=False)
    real = _real_model(checkpoint, spec)
    assert (graph.trainable_count, graph.param_count) == real.get_nb_trainable_parameters()
    magnitudes = [p for p in graph.node("layers.1").params if "lora_magnitude_vector" in p.name]
    assert magnitudes and all(p.trainable and len(p.shape) == 1 for p in magnitudes)
    torch.manual_seed(1)
    saved = _saved_per_layer(real, torch.randint(0, 512, (B, S)))
    layer = graph.node("layers.1")
    assert layer.cost().saved(B, S) == saved[1]
    # What a layer leaves allocated after its forward is what it saved, in every mode (its discarded LoRA
    # product is freed inside the layer, not carried into the next one).
    for mode in (Checkpoint.NONE, Checkpoint.FULL):
        assert layer.cost(mode).fwd_net(B, S) == layer.cost(mode).saved(B, S)
    # PEFT builds the down projection's LoRA product from an in_features^2 identity: a forward transient.
    identity = values["intermediate_size"] ** 2 * 2
    assert max(peak(1, 1) for peak in layer.cost().fwd_peak.candidates) >= identity


def test_modules_to_save_trains_a_copy_of_the_lm_head(folder, values):
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = LoraSpec(rank=8, alpha=16, modules_to_save=("lm_head",))
    graph = lower(str(folder), lora=spec, use_cache=False)
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):  # counting only
        model = get_peft_model(AutoModelForCausalLM.from_config(copy.deepcopy(config)), spec.peft_config())
    assert (graph.trainable_count, graph.param_count) == model.get_nb_trainable_parameters()
    head = graph.node("head")
    assert [p.trainable for p in head.params].count(True) == 1
    vocab_by_hidden = values["vocab_size"] * values["hidden_size"]
    assert sum(p.numel for p in head.params if p.trainable) == vocab_by_hidden
    assert head.cost().grads(B, S) == vocab_by_hidden * 2  # the copy's bf16 gradient


def test_rslora_changes_no_cost(folder, qlora_graph):
    # use_rslora only changes the adapter scaling (alpha/sqrt(r) for alpha/r): the graph is the same.
    plain = qlora_graph.to_json()
    rank_stabilised = lower(str(folder), lora=replace(QLORA, use_rslora=True), use_cache=False).to_json()
    assert plain.pop("lora") != rank_stabilised.pop("lora")
    assert plain == rank_stabilised


def test_quantized_graph_round_trips_through_json(qlora_graph):
    from graphs.graph import LayerGraph

    again = LayerGraph.from_json(qlora_graph.to_json())
    assert again.to_json() == qlora_graph.to_json()
    assert again.lora == QLORA
    assert sum(p.quantized for p in again.params()) == 7 * 3  # q, k, v, o, gate, up, down in each of 3 layers


@pytest.mark.parametrize(("fields", "message"), [
    ({"quantization": "int4"}, "quantization"),
    ({"double_quant": True}, "4-bit"),
    ({"quantization": "int8", "double_quant": True}, "4-bit"),
    ({"modules_to_save": "lm_head"}, "list of module names"),
    ({"modules_to_save": ("lm head",)}, "not a module name"),
    ({"use_dora": "yes"}, "true or false"),
])
def test_bad_lora_specs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LoraSpec(**fields)


def test_lora_spec_reads_plans_written_before_these_fields():
    old = {"rank": 16, "alpha": 32, "targets": ["all-linear"], "dropout": 0.0}
    assert LoraSpec.from_json(old) == LoraSpec()
    assert LoraSpec.from_json(QLORA.to_json()) == QLORA


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # tied and untied input/output embeddings
@pytest.mark.parametrize("modules", [("lm_head",), ("embed_tokens", "lm_head")])
def test_modules_to_save_states_equal_a_real_adamw_step_on_the_peft_model(tmp_path, arch, modules):
    """modules_to_save priced as PEFT builds it: a trained copy of each module beside the frozen original (its
    parameters, gradients and optimizer states on top of the adapters'), against the real PEFT model in fp32 and a
    real AdamW step's exp_avg/exp_avg_sq (exact bytes; `step` counters are host scalars fitplan leaves out)."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from costmodels import Config, Engine, Optimizer, Precision, lowering_for
    from costmodels.states import model_states

    config = Config(engine=Engine.DDP, precision=Precision.FP32, optimizer=Optimizer.ADAMW)
    dtype, autocast = lowering_for(config, lora=True)
    spec = LoraSpec(rank=8, alpha=16, modules_to_save=modules)
    values = tiny_values(arch)
    graph = lower(str(write_config(tmp_path, values)), lora=spec, dtype=dtype, autocast=autocast, use_cache=False)
    fields = dict(values)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32), spec.peft_config())
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(trained, lr=1e-3, foreach=True)
    optimizer.step()
    states = model_states(graph, config)
    assert states.params == sum(p.numel() * p.element_size() for p in model.parameters())
    # one micro-batch per step: the gradients live from backward to the step (none persist between steps)
    assert (states.grads, states.accumulating_grads) == (0, sum(p.numel() * p.element_size() for p in trained))
    assert states.optimizer == sum(optimizer.state[p][k].numel() * optimizer.state[p][k].element_size()
                                   for p in trained for k in ("exp_avg", "exp_avg_sq"))
    copies = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "modules_to_save" in n)
    assert copies == values["vocab_size"] * values["hidden_size"] * len(modules)  # one full copy per module
