"""Planning a TRL post-training job (`--task dpo|orpo|kto|grpo`): the reference strategy and, for GRPO, the vLLM
engine's placement and memory share, searched jointly with the training configuration.

Each candidate fixes what the training step sees (its GPUs and the memory left to it); the CP-SAT search finds the
fastest training configuration for it, and the candidate's own costs (generation, weight sync, log-prob passes)
depend on nothing the inner search decides. The fastest candidate's total is therefore the joint optimum over
(candidate x configuration), which `tests/solver/test_post_training_search.py` checks against brute force.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from costmodels import generation as G
from costmodels.config import Workload
from costmodels.tasks import GENERATION_TASKS, PAIR_TASKS, PostTraining, Reference, Task
from graphs import FitplanError
from solver.plan.launchers.trl import POST_TRAINING_RUNNERS
from solver.plan.post_training import GenerationPlan, PostTrainingPlan, StepTime
from solver.plan.record import Plan
from solver.search.diagnose import Infeasible
from solver.search.request import Request

# TRL 1.16 defaults: DPOConfig.beta 0.1, KTOConfig.beta 0.1, GRPOConfig.beta 0.0 (no reference model),
# GRPOConfig.num_generations 8 and max_completion_length 512 (trl/trainer/*_config.py).
DEFAULT_BETA = {Task.DPO: 0.1, Task.ORPO: 0.1, Task.KTO: 0.1, Task.GRPO: 0.0}
DEFAULT_COMPLETION = 512
DEFAULT_PROMPT = 512
# Colocated shares searched without sleep mode (TRL's default 0.3 among them) and the server's GPU counts.
COLOCATE_SHARES = (0.3, 0.5)
WEIGHT_ITEMSIZE = 2  # vLLM serves the 16-bit weights


@dataclass(frozen=True, slots=True, kw_only=True)
class PostRequest:
    """The post-training task as asked (None and "auto" leave a choice to the search or TRL's default)."""

    task: Task
    reference: str = "auto"
    beta: float | None = None
    prompt_len: int | None = None
    completion_len: int | None = None
    num_generations: int = 8
    vllm_mode: str = "auto"
    utilization: float | None = None
    vllm_tp: int | None = None
    sleep: bool | None = None

    @property
    def effective_beta(self) -> float:
        return DEFAULT_BETA[self.task] if self.beta is None else self.beta


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One way to place what the training step shares its GPUs with."""

    reference: Reference
    engine: G.Engine | None = None
    training_gpus: int = 0
    reserved_share: float = 0.0
    """Fraction of each training GPU's memory held by something else for the whole step (the colocated engine)."""

    def label(self) -> str:
        if self.engine is None:
            return f"reference {self.reference}"
        e = self.engine
        share = "sleep mode (share sized at wake-up)" if e.sleep else f"gpu_memory_utilization={e.utilization:g}"
        where = "" if e.placement is G.Placement.COLOCATE else f" on its own GPUs, training on {self.training_gpus}"
        return f"vLLM {e.placement}{where} tp={e.tp} {share}"


def check(post: PostRequest) -> None:
    """Refuse what is not planned, with the way out."""
    if post.task is Task.PPO:
        raise FitplanError("--task ppo is not planned: TRL 1.16 has no PPO trainer (trl.PPOTrainer was removed and "
                           "trl.experimental has none), and OpenRLHF 0.11.2's and verl 0.9.1's PPO configurations "
                           "are parsed only by code that imports Ray, so neither a PPO step nor a launcher "
                           "configuration can be checked against the runtime; its critic and reward models are "
                           "not priced.", "Plan GRPO (--task grpo), which needs no critic or reward model, or "
                           "DPO/KTO (--task dpo, --task kto) on preference data.")
    if post.task is Task.SFT:
        raise FitplanError("--task sft is the default planner; post-training options do not apply.",
                           "Leave --task out.")
    if post.task is Task.ORPO and post.reference not in ("auto", "none"):
        raise FitplanError("ORPO has no reference model.", "Leave --reference out.")
    if post.task is Task.GRPO and post.num_generations < 2:
        raise FitplanError("GRPO needs at least 2 generations per prompt (its advantages are group-relative).",
                           "Pass --num-generations 2 or more (TRL's default is 8).")


def check_launcher(launcher: str | None) -> None:
    """A pinned launcher must start TRL's trainers."""
    if launcher is not None and launcher not in POST_TRAINING_RUNNERS:
        raise FitplanError(f"--launcher {launcher} does not run TRL's post-training trainers.",
                           f"Use one of {', '.join(POST_TRAINING_RUNNERS)}, or leave --launcher out.")


def references(post: PostRequest, *, lora: bool) -> list[Reference]:
    """Reference strategies to search: the task's (none for ORPO and GRPO at beta 0); LoRA disables its adapters
    instead of copying; DPO may precompute the log-probs before training (tried when pinned or as the second)."""
    if post.reference not in ("auto",):
        return [Reference(post.reference)]
    if post.task is Task.ORPO or (post.task is Task.GRPO and post.effective_beta == 0.0):
        return [Reference.NONE]
    first = Reference.ADAPTER if lora else Reference.COPY
    return [first, Reference.PRECOMPUTED] if post.task is Task.DPO and not lora else [first]


def engines(post: PostRequest, request: Request, kv_heads: int) -> list[tuple[G.Engine, int]]:
    """(engine, training GPUs) candidates: colocated with sleep mode (the share sized after the search) or holding
    a share, and a server on a quarter or half of one node's GPUs (one whole node on several nodes)."""
    cluster = request.cluster
    world = cluster.world_size
    tps = [t for t in (1, 2, 4, 8) if t <= cluster.gpus_per_node and kv_heads % t == 0]
    tps = [post.vllm_tp] if post.vllm_tp else tps
    out: list[tuple[G.Engine, int]] = []
    if post.vllm_mode in ("auto", "colocate"):
        shares = [post.utilization] if post.utilization else list(COLOCATE_SHARES)
        for tp in tps:
            if post.sleep in (None, True):
                out.append((G.Engine(placement=G.Placement.COLOCATE, tp=tp, utilization=post.utilization or 0.0,
                                     sleep=True), world))
            if post.sleep in (None, False):
                out += [(G.Engine(placement=G.Placement.COLOCATE, tp=tp, utilization=u), world) for u in shares]
    if post.vllm_mode in ("auto", "server") and world > 1:
        sizes = [cluster.gpus_per_node] if cluster.nodes > 1 else sorted({max(1, world // 4), world // 2})
        util = post.utilization or G.SERVER_MEMORY_UTILIZATION
        out += [(G.Engine(placement=G.Placement.SERVER, tp=tp, utilization=util), world - g)
                for g in sizes for tp in tps if g % tp == 0]
    if not out:
        raise FitplanError(f"No vLLM placement fits the request (--vllm-mode {post.vllm_mode} on {world} GPUs).",
                           "Server mode needs at least 2 GPUs; drop --vllm-tp or pick one dividing the KV heads.")
    return out


def candidates(post: PostRequest, request: Request, *, kv_heads: int) -> list[Candidate]:
    """Every (reference strategy, engine placement) the search compares."""
    refs = references(post, lora=request.lora is not None)
    if post.task not in GENERATION_TASKS:
        return [Candidate(reference=r, training_gpus=request.cluster.world_size) for r in refs]
    return [Candidate(reference=r, engine=e, training_gpus=gpus,
                      reserved_share=G.engine_resident_bytes(e, 1 << 40) / (1 << 40))
            for r in refs for e, gpus in engines(post, request, kv_heads)]


Solver = Callable[[Request], Plan]


def solve_post_training(request: Request, post: PostRequest, solve: Solver) -> Plan:
    """The fastest (candidate, training configuration) pair; Infeasible when no candidate's training fits."""
    check(post)
    shape = request.resolved.as_dict()
    kv_heads = int(shape.get("num_key_value_heads") or shape.get("num_attention_heads") or 1)
    best: tuple[float, Plan, PostTrainingPlan] | None = None
    considered: list[str] = []
    failure: Infeasible | None = None
    trained: dict[tuple[Reference, int, float], Plan | Infeasible] = {}
    for cand in candidates(post, request, kv_heads=kv_heads):
        key = (cand.reference, cand.training_gpus, cand.reserved_share)
        if key not in trained:
            trained[key] = _train(request, post, cand, solve)
        found = trained[key]
        if isinstance(found, Infeasible):
            failure = found
            considered.append(f"{cand.label()}: no training plan ({found.message.split('. ')[0][:120]})")
            continue
        record = price(found, request, post, cand)
        if record is None:
            considered.append(f"{cand.label()}: no KV cache room for one sequence")
            continue
        considered.append(f"{cand.label()}: {record.time.step_time:.3g} s per step")
        if best is None or record.time.step_time < best[0]:
            best = (record.time.step_time, found, record)
    if best is None:
        if failure is not None and post.task is Task.KTO:
            failure = Infeasible(f"{failure.message} KTO trains at least two examples per micro-batch "
                                 "(KTOTrainer refuses per_device_train_batch_size 1: its KL term pairs each "
                                 "completion with another example's prompt).",
                                 "Raise --global-batch to at least 2 per data-parallel rank.", failure.diagnosis)
        raise failure or Infeasible("No post-training placement fits.", "Use LoRA (--lora-rank) or more GPUs.")
    _, plan, record = best
    runners = tuple(name for name in plan.launchers if name in POST_TRAINING_RUNNERS)
    return replace(plan, launchers=runners, post_training=replace(record, considered=tuple(considered)))


def _train(request: Request, post: PostRequest, cand: Candidate, solve: Solver) -> Plan | Infeasible:
    """The training step's own search for a candidate: its GPUs, the memory the engine leaves, its reference."""
    cluster = request.cluster
    if cand.training_gpus != cluster.world_size:
        per_node = min(cluster.gpus_per_node, cand.training_gpus)
        cluster = replace(cluster, nodes=cand.training_gpus // per_node, gpus_per_node=per_node)
    workload = replace(request.workload, post=replace(request.workload.post, reference=cand.reference))
    headroom = request.headroom + cand.reserved_share
    if headroom >= 1:
        return Infeasible("the engine's share leaves no memory to train", "Lower the share.")
    held = f", {cand.reserved_share:.0%} of each GPU held by the colocated vLLM engine" if cand.reserved_share else ""
    inner = replace(request, cluster=cluster, workload=workload, headroom=headroom).with_notes(
        f"post-training: the policy trains on {cand.training_gpus} GPUs with reference {cand.reference}{held}")
    try:
        return solve(inner)
    except Infeasible as err:
        return err
    except FitplanError as err:  # e.g. no data-parallel degree divides the batch on the remaining GPUs
        return Infeasible(err.message, err.hint)


def model_shape(plan: Plan) -> G.ModelShape:
    """The generation engine's view of the model, from the plan's recorded shape (16-bit weights)."""
    inputs, shape = plan.inputs, plan.inputs.shape
    assert shape is not None
    h, layers, hd = inputs.hidden_size, inputs.num_layers, shape.head_dim
    attention = h * shape.heads * hd * 2 + h * shape.kv_heads * hd * 2
    mlp = (3 if shape.gated_silu else 2) * h * shape.ffn_hidden
    params = layers * (attention + mlp) + shape.vocab * h * (1 if shape.tied_embeddings else 2)
    return G.ModelShape(params=params, weight_bytes=params * WEIGHT_ITEMSIZE, layers=layers, kv_heads=shape.kv_heads,
                        head_dim=hd, hidden=h, intermediate=shape.ffn_hidden, vocab=shape.vocab)


def forward_flops(shape: G.ModelShape, plan: Plan) -> float:
    """FLOPs of one no-grad forward over the step's sequences: 2 per parameter per token, plus causal attention."""
    s, sequences = plan.inputs.seq_len, plan.inputs.global_batch
    heads_dim = (plan.inputs.shape.heads if plan.inputs.shape else 0) * shape.head_dim
    attention = 2 * 2 * shape.layers * s * s * heads_dim * 0.5
    return sequences * (2 * shape.params * s + attention)


def price(plan: Plan, request: Request, post: PostRequest, cand: Candidate) -> PostTrainingPlan | None:
    """The candidate's whole step: its training plan plus generation, weight sync and log-prob passes."""
    spec = request.workload.post
    assert spec is not None
    shape, gpu = model_shape(plan), request.cluster.gpu
    completion = plan.inputs.seq_len - spec.prompt_len
    passes = logprob_forwards(post.task, cand.reference)
    logprob = passes * G.logprob_pass_seconds(forward_flops(shape, plan), gpu, gpus=cand.training_gpus)
    generation, sync, engine_plan = 0.0, 0.0, None
    if cand.engine is not None:
        engine = cand.engine
        if engine.sleep:  # the share vLLM may take at wake-up: what the trainer's resident states leave
            engine = replace(engine, utilization=sleep_share(plan, request))
        gen_gpus = cand.training_gpus if engine.placement is G.Placement.COLOCATE else \
            request.cluster.world_size - cand.training_gpus
        timed = G.generation_time(shape, engine, gpu, engine_gpus=gen_gpus, completions=plan.inputs.global_batch,
                                  prompt=spec.prompt_len, completion=completion)
        if timed is None:
            return None
        generation, sync = timed.total, G.weight_sync_seconds(shape, engine, gpu)
        engine_plan = GenerationPlan(
            vllm_mode=str(engine.placement), vllm_gpu_memory_utilization=round(engine.utilization, 2),
            vllm_tensor_parallel_size=engine.tp, vllm_enable_sleep_mode=engine.sleep, generation_gpus=gen_gpus,
            training_gpus=cand.training_gpus, kv_cache_bytes_per_gpu=G.kv_cache_bytes(shape, engine, gpu),
            kv_blocks=G.kv_blocks(shape, engine, gpu), block_size=G.VLLM_BLOCK_SIZE,
            concurrent_sequences=timed.concurrent, waves=timed.waves,
            resident_bytes_during_training=G.engine_resident_bytes(engine, gpu.memory_bytes))
    training = plan.estimate.time.step_time
    total = generation + sync + logprob + training
    group = spec.sequences_per_example
    return PostTrainingPlan(
        task=str(post.task), reference=str(cand.reference), beta=post.effective_beta, prompt_len=spec.prompt_len,
        completion_len=completion, examples_per_step=plan.inputs.global_batch // group,
        per_device_train_batch_size=plan.decisions.micro_batch // group, num_generations=spec.num_generations,
        reference_bytes_per_gpu=_reference_bytes(shape, plan, cand.reference), generation=engine_plan,
        time=StepTime(generation=generation, weight_sync=sync, logprob_passes=logprob, training=training,
                      step_time=total), notes=_notes(post, cand))


def logprob_forwards(task: Task, reference: Reference) -> int:
    """No-grad forwards over the step's sequences beside the policy's training forward: the reference's (DPO's
    precompute as its share of one epoch); KTO's KL term, a policy forward on mismatched completions and, with a
    live reference, the reference's on them too (`KTOTrainer._compute_kl_logps`, TRL's default `loss_type="kto"`);
    GRPO's old-policy pass (TRL computes it for vLLM's importance-sampling correction, on by default)."""
    live = reference in (Reference.COPY, Reference.ADAPTER)
    passes = int(live or reference is Reference.PRECOMPUTED)
    if task is Task.KTO:
        passes += 1 + int(live)
    return passes + int(task is Task.GRPO)


def sleep_share(plan: Plan, request: Request) -> float:
    """The `gpu_memory_utilization` a sleeping colocated engine can take when it wakes: the usable memory less what
    the trainer keeps between steps (its states; activations are gone), rounded down to a hundredth."""
    memory = plan.estimate.memory
    resident = memory.parameters + memory.gradients + memory.optimizer_states + memory.overhead
    total = request.cluster.gpu.memory_bytes
    return max(0.0, int(100 * (total * (1 - request.headroom) - resident) / total) / 100)


def _reference_bytes(shape: G.ModelShape, plan: Plan, reference: Reference) -> int:
    """A frozen copy's 16-bit weights on one GPU (split by TP and, at ZeRO-3/FSDP2 resharding, the data ranks)."""
    if reference is not Reference.COPY:
        return 0
    d = plan.decisions
    return shape.weight_bytes // (d.tp * (d.dp * d.cp if d.zero == 3 else 1))


def _notes(post: PostRequest, cand: Candidate) -> tuple[str, ...]:
    notes = []
    if post.task in PAIR_TASKS:
        notes.append("chosen and rejected of each pair run in one micro-batch (TRL concatenates them): micro_batch "
                     "counts sequences, per_device_train_batch_size pairs")
    if cand.reference is Reference.PRECOMPUTED:
        notes.append("precompute_ref_log_probs: one no-grad pass over the dataset before training, priced per step "
                     "as its share of one epoch")
    if post.task is Task.KTO:
        notes.append("KTO's KL term: no-grad forwards of the policy and the reference on mismatched completions, "
                     "priced as log-prob passes; TRL needs per_device_train_batch_size > 1 for it")
    if post.task is Task.ORPO:
        notes.append("ORPO (trl.experimental) computes full logits: priced as the SFT cross-entropy, without reference")
    if cand.engine is not None:
        notes.append("every completion is priced at max_completion tokens; vLLM's prefix sharing within a prompt's "
                     "group is not counted (upper bound on KV use)")
    return tuple(notes)


def post_workload(post: PostRequest | None, workload: Workload, assumed: list[str]) -> Workload:
    """The workload of a post-training request: `workload.global_batch` counts examples (pairs, or GRPO's
    completions, rounded up to whole groups of num_generations); sequences are prompt + completion tokens. Without
    a request, `workload` unchanged."""
    if post is None:
        return workload
    seq_len = workload.seq_len
    prompt = post.prompt_len if post.prompt_len is not None else (
        DEFAULT_PROMPT if post.task in GENERATION_TASKS else seq_len // 2)
    if prompt >= seq_len:
        raise FitplanError(f"prompt length {prompt} leaves no completion in sequences of {seq_len} tokens.",
                           "Lower --max-prompt or raise --seq-len / --max-completion.")
    generations = post.num_generations if post.task in GENERATION_TASKS else 1
    examples = -(-workload.global_batch // generations) * generations
    if examples != workload.global_batch:
        assumed.append(f"global batch {examples} completions: whole groups of {generations} generations")
    spec = PostTraining(task=post.task, prompt_len=prompt, num_generations=generations)
    return Workload(seq_len=seq_len, global_batch=examples * spec.sequences_per_example, post=spec)


def estimated_workload(post: PostRequest | None, workload: Workload, assumed: list[str], *,
                       lora: bool) -> Workload:
    """The workload `estimate` prices for a post-training request: `post_workload`'s, as `solve` builds it, with the
    reference strategy pinned, or the first one `solve` searches (a copy, or LoRA's adapter-disabled base)."""
    if post is None:
        return workload
    workload = post_workload(post, workload, assumed)
    assert workload.post is not None
    reference = references(post, lora=lora)[0]
    return replace(workload, post=replace(workload.post, reference=reference))


def colocated_share(post: PostRequest | None) -> float:
    """The share of each training GPU a colocated vLLM engine holds during training, as `solve`'s candidate
    reserves it: with `--vllm-mode colocate`, the pinned `gpu_memory_utilization` (TRL's default 0.3) unless sleep
    mode frees it (off by default, as in TRL); a server or no engine holds nothing."""
    if post is None or post.task not in GENERATION_TASKS or post.vllm_mode != "colocate":
        return 0.0
    engine = G.Engine(placement=G.Placement.COLOCATE, tp=post.vllm_tp or 1, sleep=bool(post.sleep),
                      utilization=post.utilization or G.COLOCATE_DEFAULT_UTILIZATION)
    return G.engine_resident_bytes(engine, 1 << 40) / (1 << 40)


def request_of(record: PostTrainingPlan) -> PostRequest:
    """The post-training request that reproduces a plan's record (its task, reference, lengths and engine)."""
    engine = record.generation
    return PostRequest(task=Task(record.task), reference=record.reference, beta=record.beta,
                       prompt_len=record.prompt_len, completion_len=record.completion_len,
                       num_generations=record.num_generations,
                       vllm_mode=engine.vllm_mode if engine else "auto",
                       utilization=engine.vllm_gpu_memory_utilization if engine else None,
                       vllm_tp=engine.vllm_tensor_parallel_size if engine else None,
                       sleep=engine.vllm_enable_sleep_mode if engine else None)


def plan_request(plan: Plan) -> tuple[PostRequest | None, int]:
    """The post-training request of a plan (None for SFT) and its global batch in the request's unit (examples:
    pairs for DPO/ORPO), as `solve` was given it."""
    record = plan.post_training
    if record is None:
        return None, plan.inputs.global_batch
    request = request_of(record)
    return request, plan.inputs.global_batch // (2 if request.task in PAIR_TASKS else 1)


def sequence_length(post: PostRequest | None, seq_len: int | None, *, dataset_lengths: object = None) -> int | None:
    """The sequence length a post-training request implies (prompt + completion when the completion is given), after
    checking the request; `seq_len` unchanged without one."""
    if post is None:
        return seq_len
    check(post)
    if dataset_lengths is not None:
        raise FitplanError("--dataset-lengths is not planned with --task yet.", "Leave it out.")
    if post.completion_len is None:
        return seq_len
    prompt = post.prompt_len if post.prompt_len is not None else DEFAULT_PROMPT
    if seq_len is not None and seq_len != prompt + post.completion_len:
        raise FitplanError(f"--seq-len {seq_len} contradicts --max-prompt {prompt} + --max-completion "
                           f"{post.completion_len}.", "Give either --seq-len or the prompt and completion lengths.")
    return prompt + post.completion_len
