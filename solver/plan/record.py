"""`Plan`: the solver's answer — inputs, decisions, estimate, solver statistics and alternatives — and its
versioned JSON form. The JSON Schema is generated from these dataclasses (never written by hand)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from costmodels import Config, Estimate, Offload
from costmodels.knobs import Knob, declared
from graphs import Checkpoint, FitplanError, LoraSpec, MalformedConfig
from graphs.files import parse_json, read_text
from solver.plan.capability import engine_label
from solver.plan.post_training import PostTrainingPlan

SCHEMA_VERSION = "2.8"  # 2.1: pipeline, context and expert parallelism (pp, pp_schedule, ..., cp, ep); 2.2: engine
# megatron (Megatron's own DDP and distributed optimizer) and optimizer adamw-bf16; 2.3: solver.lowering_seconds (the
# search's time apart from the lowering's) and the estimate's memory.fragmentation_risk (classic allocator); 2.4:
# solver.deterministic (--deterministic: a fixed work budget instead of the wall clock) and the model's rope_scaling,
# attention_dropout and hidden_dropout (what the Megatron and torchtitan files build); 2.5: post_training (--task:
# DPO/ORPO/KTO/GRPO, the reference strategy, the vLLM engine and the step's time by phase); 2.6: dp_replicate (hybrid
# sharding, FSDP2's HSDP); 2.7: lora.kbit_preparation (a QLoRA script that calls PEFT's k-bit preparation); 2.8:
# optimizer_offload_fraction (Megatron's hybrid device optimizer: a share of the states on the host)
_CONFIG = ConfigDict(use_attribute_docstrings=True)


@dataclass(frozen=True, kw_only=True)
class ClusterInfo:
    """The hardware the plan is for."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    spec: str
    """What the user gave, e.g. "8xA100"."""
    gpu: str
    """Catalog id of the GPU."""
    gpu_name: str
    nodes: int
    gpus_per_node: int
    gpu_memory_bytes: int
    cpu_ram_per_node_bytes: int
    inter_node_bytes_per_s: float
    nvme_bytes_per_s: float
    assumptions: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE scaling as the model's config.json states it (`rope_scaling`, or `rope_parameters` in transformers 5)."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    kind: str
    """Its rope_type: llama3, linear, yarn, dynamic, ..."""
    factor: float
    """How much longer a context it stretches the positions to."""
    low_freq_factor: float | None = None
    """llama3: wavelengths beyond original_max_positions / low_freq_factor are divided by factor."""
    high_freq_factor: float | None = None
    """llama3: wavelengths below original_max_positions / high_freq_factor are kept."""
    original_max_positions: int | None = None
    """The context the model was pre-trained at before scaling (original_max_position_embeddings)."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The architecture a launcher that builds the model itself needs (Megatron-LM's model flags)."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    heads: int
    kv_heads: int
    """Key/value heads (fewer than heads: grouped-query attention)."""
    head_dim: int
    ffn_hidden: int
    vocab: int
    max_positions: int
    """Position embeddings to allocate (at least the planned sequence length)."""
    normalization: str
    """RMSNorm or LayerNorm."""
    norm_epsilon: float | None = None
    gated_silu: bool
    """SwiGLU MLP (gate and up projections, SiLU)."""
    rope: bool
    """Rotary position embeddings (else learned absolute positions)."""
    rope_theta: float | None = None
    """RoPE's base (config.json's rope_theta, else the config class's default)."""
    rope_scaling: RopeScaling | None = None
    """RoPE scaling, if config.json states one (none: plain RoPE)."""
    tied_embeddings: bool
    """Output layer shares the input embedding's weights."""
    linear_bias: bool
    qkv_bias: bool = False
    """Bias on the q/k/v projections only (Qwen2)."""
    experts: int = 0
    """Routed experts of each MoE layer (0: a dense model)."""
    top_k: int = 0
    """Experts each token is routed to."""
    expert_ffn_hidden: int = 0
    """FFN width of one expert (0: ffn_hidden, as in Mixtral)."""
    aux_loss_coeff: float = 0.0
    """Weight of the router's load-balancing loss the model was trained with (config.json `router_aux_loss_coef`)."""
    router_pre_softmax: bool = False
    """Top-k weights from the softmax over all experts, not renormalised (Qwen3-MoE without `norm_topk_prob`)."""
    qk_norm: bool = False
    """A norm over each head's queries and keys before RoPE (Qwen3)."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (config.json's, 0 when it states none)."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs (config.json's, 0 when it states none)."""


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """What was asked, including every default fitplan assumed."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    model: str
    model_source: str
    """catalog, local or hf-cache."""
    architecture: str = ""
    """The transformers class, e.g. LlamaForCausalLM."""
    layer_class: str = ""
    """The decoder-layer class, e.g. LlamaDecoderLayer."""
    hidden_size: int = 0
    num_layers: int = 0
    cluster: ClusterInfo
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    tokens_per_step: int
    headroom: float
    """Fraction of device memory kept free."""
    pins: dict[str, Any] = field(default_factory=dict)
    """Knobs the user fixed."""
    assumed: tuple[str, ...] = ()
    """Defaults fitplan chose, in words."""
    shape: ModelShape | None = None
    """The model's architecture (absent in plans before schema 1.2)."""
    packing: str | None = None
    """How --dataset-lengths were batched (none: padded to each micro-batch's longest; wrapped, bfd: packed rows);
    None without dataset lengths, when every row is priced full at seq_len tokens, as packing fills them."""


@dataclass(frozen=True, kw_only=True)
class LoraDecision:
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    rank: int
    alpha: int
    targets: tuple[str, ...]
    dropout: float
    quantization: str | None = None
    """bitsandbytes format of the frozen base weights (QLoRA: nf4 or fp4), or None for 16-bit base weights."""
    double_quant: bool = False
    """The 4-bit block scales quantized again (`bnb_4bit_use_double_quant`)."""
    use_dora: bool = False
    """DoRA: a trained magnitude vector per adapted layer (`LoraConfig(use_dora=True)`)."""
    use_rslora: bool = False
    """rsLoRA: adapters scaled by alpha/sqrt(rank) instead of alpha/rank (`LoraConfig(use_rslora=True)`; no cost)."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full beside the adapters, e.g. lm_head (`LoraConfig(modules_to_save=...)`)."""
    kbit_preparation: bool = False
    """The training script calls PEFT's `prepare_model_for_kbit_training` on the 4-bit base (`--kbit-preparation`:
    every 16-bit parameter outside the 4-bit layers in fp32, priced so); only the hf and accelerate files, which leave
    the script to the user, run such a plan."""

    def spec(self) -> LoraSpec:
        """The `graphs.LoraSpec` these adapters are lowered and emitted from."""
        return LoraSpec(rank=self.rank, alpha=self.alpha, targets=self.targets, dropout=self.dropout,
                        quantization=self.quantization, double_quant=self.double_quant, use_dora=self.use_dora,
                        use_rslora=self.use_rslora, modules_to_save=self.modules_to_save)

    @classmethod
    def of(cls, spec: LoraSpec, *, kbit_preparation: bool = False) -> LoraDecision:
        return cls(rank=spec.rank, alpha=spec.alpha, targets=spec.targets, dropout=spec.dropout,
                   quantization=None if spec.quantization is None else spec.quantization.value,
                   double_quant=spec.double_quant, use_dora=spec.use_dora, use_rslora=spec.use_rslora,
                   modules_to_save=spec.modules_to_save, kbit_preparation=kbit_preparation)


@dataclass(frozen=True, kw_only=True)
class Decisions(Config):
    """Every knob of the chosen configuration: the knob record's `Config` and what only the plan records."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    lora: Annotated[LoraDecision | None, Knob("LoRA adapters trained instead of the full model (--lora-rank, "
                                              "--allow-lora).", pin="derived")] = None
    attention: Annotated[str, Knob("Attention implementation the model was lowered with (--attention).",
                                   pin="derived")] = "sdpa"
    dataloader_num_workers: Annotated[int, Knob("Data-loading worker processes per GPU (sized from the node's CPU "
                                                "cores).", pin="derived")] = 2
    dataloader_pin_memory: Annotated[bool, Knob("Pinned host memory for input batches.", pin="derived")] = True

    def layout(self) -> str:
        """How the GPUs are divided, e.g. "tp=4 pp=4 (1f1b) dp=1": pipeline, context and expert degrees where used."""
        parts = [f"tp={self.tp}"]
        if self.pp > 1:
            virtual = f" v={self.pp_virtual}" if self.pp_virtual > 1 else ""
            parts.append(f"pp={self.pp} ({self.pp_schedule}{virtual})")
        if self.cp > 1:
            parts.append(f"cp={self.cp} ({self.cp_mode})")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        # knobs declared `Knob.shown`, where they are not their default (e.g. a data-parallel split)
        parts += [f"{name}={getattr(self, name)}" for name, knob in declared(Config).items()
                  if knob.knob.shown and getattr(self, name) != knob.default]
        return " ".join([*parts, f"dp={self.dp}"])

    def summary(self) -> str:
        ckpt = {m: sum(c is m for c in self.checkpoint) for m in Checkpoint}
        parts = [self.layout(), engine_label(self.engine, self.zero),
                 f"mb={self.micro_batch}", f"ga={self.grad_accum}", str(self.precision), str(self.optimizer),
                 f"ckpt full {ckpt[Checkpoint.FULL]}/sel {ckpt[Checkpoint.SELECTIVE]}"
                 + (f"/op-sel {ckpt[Checkpoint.OP_SELECTIVE]}" if ckpt[Checkpoint.OP_SELECTIVE] else "")
                 + f"/{len(self.checkpoint)}"]
        if self.optimizer_offload is not Offload.NONE:
            share = f"({self.optimizer_offload_fraction:g})" if self.optimizer_offload_fraction != 1 else ""
            parts.append(f"opt-offload={self.optimizer_offload}{share}")
        if self.param_offload is not Offload.NONE:
            parts.append(f"param-offload={self.param_offload}")
        savers = (("optimizer-in-backward", self.optimizer_in_backward), (f"loss={self.loss}", self.loss != "hf"),
                  ("activation-offload", self.activation_offload))
        parts += [name for name, on in savers if on]
        if self.lora:
            kind = "QLoRA" if self.lora.quantization else "LoRA"
            parts.append(f"{kind}{'+DoRA' if self.lora.use_dora else ''}{'+rsLoRA' if self.lora.use_rslora else ''}"
                         f" r={self.lora.rank}" + (f" {self.lora.quantization}" if self.lora.quantization else "")
                         + (f" saving {','.join(self.lora.modules_to_save)}" if self.lora.modules_to_save else ""))
        return " ".join(parts)


def decisions_of(outer: Config, checkpoint: tuple[Checkpoint, ...], *, lora: LoraDecision | None = None,
                 attention: str = "sdpa") -> Decisions:
    """The decisions of one outer configuration with its per-layer checkpoint modes."""
    knobs = {name: getattr(outer, name) for name in declared(Config) if name != "checkpoint"}
    return Decisions(**knobs, checkpoint=checkpoint, lora=lora, attention=attention)


@dataclass(frozen=True, kw_only=True)
class SolverStats:
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    status: str
    """OPTIMAL (proved best under the cost model), FEASIBLE (time limit or work budget hit) or INFEASIBLE."""
    objective_seconds: float
    """Step time the solver optimised (its integer resolution)."""
    bound_seconds: float | None
    """Best lower bound on the step time CP-SAT proved."""
    gap: float | None
    wall_seconds: float
    """Search time: building the cost tables, the searches and the alternatives (what the time limit bounds),
    lowering excluded."""
    configurations: int
    """Outer configurations in the search space."""
    considered: int
    """Configurations left after exact pruning by bounds: each solved by CP-SAT, or settled by evaluating its few
    count vectors below the best so far (`count_search`)."""
    time_limit_seconds: float
    """The wall-clock limit of the search, or under `deterministic` each CP-SAT model's work budget in
    deterministic seconds."""
    explored: int | None = None
    """Configurations whose costs were built before the time limit (all of them unless the limit cut the search;
    absent in 1.0 plans)."""
    lowering_seconds: float | None = None
    """Time spent lowering the model's variants before the search, outside the time limit (absent before 2.1)."""
    deterministic: bool = False
    """Searched with `--deterministic`: every configuration built and searched, CP-SAT on one worker within a fixed
    work budget, no wall-clock cut, so the same request gives the same plan under any load (absent before 2.4)."""

    def summary(self) -> str:
        """One line: the status and the search's own time, the lowering's apart; when the limit cut the search, how
        much was explored and the way on."""
        lowering = "" if self.lowering_seconds is None else \
            f", after {self.lowering_seconds:.2f} s of lowering (outside the limit)"
        budget = f"deterministic: {self.time_limit_seconds:g} s of CP-SAT work per model" if self.deterministic \
            else f"limit {self.time_limit_seconds:g} s"
        text = (f"{self.status} in {self.wall_seconds:.2f} s of search ({budget}){lowering}, {self.considered} of "
                f"{self.configurations} configurations searched exactly")
        explored = self.configurations if self.explored is None else self.explored
        if self.status != "OPTIMAL" and self.deterministic:
            gap = "" if self.gap is None else f", gap {self.gap:.1%}"
            text += f"; the work budget cut a CP-SAT model{gap}: not proven best: raise --time-limit"
        elif self.status != "OPTIMAL":
            gap = "" if self.gap is None else f", gap {self.gap:.1%} within them"
            text += (f"; time limit {self.time_limit_seconds:g} s reached: {explored} of {self.configurations} "
                     f"configurations explored{gap}; not proven best: raise --time-limit")
        return text


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A distinct configuration that lost, and why."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    decisions: str
    step_time: float | None
    """Seconds, or None when it does not fit."""
    device_peak: int
    """Bytes per GPU."""
    fits: bool
    why: str


@dataclass(frozen=True, kw_only=True)
class ScheduleOption:
    """The chosen pipeline layout and recompute under one schedule, so a plan says why its schedule won."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    schedule: str
    virtual: int
    """Stages per rank."""
    split: tuple[int, ...] = ()
    """Decoder layers of each stage it was priced at (its own FLOP-balanced split unless it is the chosen
    schedule)."""
    step_time: float
    bubble: float
    """Seconds the busiest rank waits per step."""
    device_peak: int
    """Bytes on the fullest rank."""
    fits: bool
    chosen: bool = False


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to run the job: the answer of `solver.solve`."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    schema_version: str = SCHEMA_VERSION
    inputs: Inputs
    decisions: Decisions
    estimate: Estimate
    solver: SolverStats
    alternatives: tuple[Alternative, ...] = ()
    launchers: tuple[str, ...] = ()
    """Launchers that can run this plan as emitted."""
    binding: str = ""
    """Which constraint binds: memory, or nothing (the fastest configuration already fits)."""
    advice: tuple[str, ...] = ()
    """Guide methods and what the plan did with each."""
    schedules: tuple[ScheduleOption, ...] = ()
    """A pipeline plan: its layout and recompute priced under each schedule the search had (the chosen first)."""
    post_training: PostTrainingPlan | None = None
    """DPO/ORPO/KTO/GRPO (`--task`): reference strategy, generation engine and the whole step's time."""

    def to_json(self) -> dict[str, Any]:
        return adapter().dump_python(self, mode="json")

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        """The plan of `solve -o`; a 1.x plan is read with its pins renamed to the knob record's names, and a
        plan of a newer schema is refused (its fields may mean something this version does not know)."""
        major = check_schema_version(data.get("schema_version") if isinstance(data, dict) else None)
        return adapter().validate_python(upgrade_1x(data) if major == 1 else data)


# Schema 2.0 records pins by knob name (costmodels.knobs); 1.x used these names.
_PINS_1X = {"offload": "optimizer_offload", "precisions": "precision", "optimizers": "optimizer"}


def upgrade_1x(data: dict[str, Any]) -> dict[str, Any]:
    """A 1.x plan's JSON in the 2.0 form: the same decisions and estimate, pins under the knobs' names."""
    inputs = data.get("inputs")
    if not isinstance(inputs, dict) or not isinstance(inputs.get("pins"), dict):
        return data
    pins = {_PINS_1X.get(name, name): value for name, value in inputs["pins"].items()
            if not (name == "compile" and value == "auto")}
    if pins.get("compile") in ("on", "off"):
        pins["compile"] = pins["compile"] == "on"
    return {**data, "inputs": {**inputs, "pins": pins}}


def check_schema_version(version: object) -> int:
    """The major version of `version` ("MAJOR.MINOR"); FitplanError unless this fitplan reads it: 1.x, and 2.x up
    to this minor."""
    ours = tuple(int(part) for part in SCHEMA_VERSION.split("."))
    parts = version.split(".") if isinstance(version, str) else []
    theirs = tuple(int(p) for p in parts if p.isdigit() and len(p) <= 6)
    if len(theirs) != 2 or len(parts) != 2 or theirs[0] not in (1, ours[0]) or \
            (theirs[0] == ours[0] and theirs[1] > ours[1]):
        shown = repr(version)[:40]
        raise FitplanError(f"The plan's schema_version {shown} is not one this fitplan reads: it reads "
                           f"1.x and {ours[0]}.0 to {SCHEMA_VERSION}.",
                           "Re-create the plan with this fitplan (`solve ... -o plan.json`), or upgrade fitplan.")
    return theirs[0]


@functools.cache
def adapter() -> TypeAdapter[Plan]:
    """The plan's pydantic reader and writer, built on first use: building it takes ~0.1 s, which `--help` and
    every command that never reads or writes a plan's JSON would pay at import."""
    return TypeAdapter(Plan)


def load_plan(path: Path) -> Plan:
    """The plan in a JSON file written by `solve -o`, as its schema reads it (no check against its model)."""
    try:
        return Plan.from_json(parse_json(read_text(path, what="plan file"), where=str(path)))
    except (ValueError, ValidationError) as error:  # a file that cannot be read says so itself (graphs.files)
        raise MalformedConfig(f"{path} is not a fitplan plan: {str(error).splitlines()[0]}",
                              "Write one with `solve ... -o plan.json`.") from error


def json_schema() -> dict[str, Any]:
    """The plan's JSON Schema (published as solver/plan/schema/plan.schema.json)."""
    schema = adapter().json_schema(mode="serialization")
    schema["$id"] = f"https://fitplan.dev/schema/plan-{SCHEMA_VERSION}.json"
    schema["title"] = "fitplan Plan"
    return schema
