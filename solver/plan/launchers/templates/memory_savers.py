# fitplan: template only
"""The memory savers of the emitted training script: torchtune's chunked cross-entropy and activation offloading
(issue 14), written anew in plain PyTorch (torchtune is not a dependency). The second part of train_fitplan.py,
after train_fitplan.py's own lines; its values are the constants the cost model prices these savers with
(`torchrun_savers.SAVER_VALUES`)."""
# ANN001/ANN201: emitted script code, without annotations (see this package's docstring).
# ruff: noqa: ANN001, ANN201

import contextlib

import torch

from .train_fitplan import PLAN

# torchrun.emit writes the priced values in place of these; the defaults only let the template import.
__CHUNKS__ = 1
__MIN_OFFLOAD_BYTES__ = 0
__FORWARD_STASH__ = 1
# fitplan: end template only


# torchtune's chunked cross-entropy as the plan prices it (torchtune 0.6.1 `CEWithChunkedOutputLoss(8)`, the
# decoder's `chunked_output`, the recipe's `hstack` label shift); -100 is the ignored label (torch's default).
CHUNKS = __CHUNKS__
IGNORE_INDEX = -100
# torchtune `OffloadActivations(min_offload_size=1024)`: smaller saved tensors stay on the device.
MIN_OFFLOAD_BYTES = __MIN_OFFLOAD_BYTES__
FORWARD_STASH = __FORWARD_STASH__
# While a report measures a forward (`saved_bytes`): who counts the saved tensors that stay on the device under
# activation offload (kept by the offloading hooks, or saved by the head under its no-op hooks).
DEVICE_WATCHERS = []


def unwrapped(model):
    """The transformers CausalLM inside DDP's and PEFT's wrappers."""
    model = getattr(model, "module", model)  # DDP
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply_chunked_output(model):
    """Make the CausalLM's forward return the logits as a list of CHUNKS chunks along the sequence, the head run on
    each `h.chunk(CHUNKS, dim=1)` of the decoder's final (normed) hidden states, as torchtune's
    `TransformerDecoder.chunked_output` does; the loss is `chunked_cross_entropy`. The forward is replaced on the
    instance, so FSDP2's and DDP's hooks on the model still run around it."""
    causal = unwrapped(model)
    decoder = getattr(causal, causal.base_model_prefix)  # embeddings, layers and the final norm
    head = causal.get_output_embeddings()

    def chunked_forward(input_ids=None, attention_mask=None, **ignored):
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return [head(chunk) for chunk in hidden.chunk(CHUNKS, dim=1)]

    causal.forward = chunked_forward


def chunked_cross_entropy(chunks, labels):
    """torchtune's `CEWithChunkedOutputLoss` after its recipe's label shift: labels shifted left with
    `torch.hstack` and an ignored last position, one fp32 upcast and a summed cross-entropy per chunk, divided by
    the number of real tokens; the same value as transformers' mean `ForCausalLMLoss` on the whole logits."""
    import torch.nn.functional as F

    ignore = torch.full_like(labels[:, :1], IGNORE_INDEX)
    shifted = torch.hstack((labels[..., 1:], ignore))
    real = (shifted != IGNORE_INDEX).sum()
    targets = [chunk.reshape(-1) for chunk in shifted.chunk(CHUNKS, dim=1)]
    logits = [chunk.reshape(-1, chunk.size(-1)) for chunk in chunks]
    total = 0.0
    for logit, target in zip(logits, targets, strict=True):
        total = total + F.cross_entropy(logit.float(), target, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / real


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """torchtune's activation offloading: every tensor autograd saves in the forward that holds at least
    MIN_OFFLOAD_BYTES and is not a parameter or buffer is copied to (pinned) host memory and brought back when
    backward needs it; smaller ones stay where they are. On CUDA the copies run on a side stream: the forward keeps
    the last FORWARD_STASH offloaded tensors on the device until their copies are done, and backward copies each
    tensor back on the side stream when its node unpacks it, the compute stream waiting for it (torchtune's
    `unpack_tensor_with_streams`; its memory is released through `record_stream` rather than torchtune's per-node
    events: the caching allocator frees it once the compute stream has run its node, within the one node ahead
    fitplan prices). On the CPU the device is the host: the copy is made all the same, so a run counts what would
    move.

    `moved` and `kept` count the bytes sent to the host and the bytes of non-parameter saved tensors left where they
    are (each saved tensor, as torchtune copies each one)."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"
        self.moved = self.kept = self.count = 0
        self.saved, self.stash = {}, {}
        self.backward_started = False
        if self.cuda:
            self.compute, self.side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor):
        self.count += 1
        key = self.count
        size = tensor.numel() * tensor.element_size()
        on_host = self.cuda and not tensor.is_cuda  # already on the host (torchtune offloads device tensors only)
        if size < MIN_OFFLOAD_BYTES or on_host or isinstance(tensor, (torch.nn.Parameter, torch.nn.Buffer)):
            if not isinstance(tensor, torch.nn.Parameter):
                self.kept += size
                if DEVICE_WATCHERS:
                    DEVICE_WATCHERS[-1](tensor)
            self.saved[key] = (False, tensor)
            return key
        self.moved += size
        if not self.cuda:
            self.saved[key] = (True, tensor.detach().clone())
            return key
        for old in list(self.stash)[:max(0, len(self.stash) - FORWARD_STASH + 1)]:
            self.compute.wait_event(self.stash.pop(old)[1])  # copied long enough ago: the device tensor can go
        self.side.wait_stream(self.compute)
        with torch.cuda.stream(self.side):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            done = self.side.record_event()
        self.stash[key] = (tensor, done)
        self.saved[key] = (True, host)
        return key

    def unpack(self, key):
        moved, tensor = self.saved.pop(key)
        if not self.backward_started:
            self.backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)
        if not moved or not self.cuda:
            return tensor  # kept as saved; on the CPU the host copy is already where the device would be
        if key in self.stash:  # its device tensor is still here
            return self.stash.pop(key)[0]
        with torch.cuda.stream(self.side):
            back = tensor.to(self.device, non_blocking=True)
        self.compute.wait_stream(self.side)
        back.record_stream(self.compute)  # its memory is reused only once the compute stream is done with it
        return back

    def backward_done(self):
        """End of backward: what the forward stash still holds goes (its copies done)."""
        if self.cuda:
            for _, done in self.stash.values():
                self.compute.wait_event(done)
        self.stash.clear()
        self.backward_started = False


class DeviceSaved(torch.autograd.graph.saved_tensors_hooks):
    """torchtune's `NoOpManager` around the head: its saved tensors stay on the device (counted by a report)."""

    def __init__(self):
        def keep(tensor):
            if DEVICE_WATCHERS:
                DEVICE_WATCHERS[-1](tensor)
            return tensor

        super().__init__(keep, lambda tensor: tensor)


def keep_head_on_device(model):
    """Run the output projection under `DeviceSaved`, as torchtune's `get_act_offloading_ctx_manager` runs it
    under a `NoOpManager`; called once (hooks on the head module, so every call of it, chunk by chunk)."""
    head = unwrapped(model).get_output_embeddings()
    scopes = []

    def enter(module, args):
        scopes.append(DeviceSaved())
        scopes[-1].__enter__()

    def leave(module, args, output):
        scopes.pop().__exit__(None, None, None)

    head.register_forward_pre_hook(enter)
    head.register_forward_hook(leave)


def forward_loss(model, ids, labels, offload=None):
    """One micro-batch's loss as the plan computes it: transformers' own loss, Liger's patch, or torchtune's
    chunked cross-entropy; with activation offload the model's forward runs under `offload` and the loss outside
    it (torchtune's recipes), so the loss's saved tensors stay on the device."""
    d = PLAN["decisions"]
    chunked = d.get("loss") == "chunked"
    if offload is None and not chunked:
        return model(input_ids=ids, labels=labels, use_cache=False).loss
    with offload if offload is not None else contextlib.nullcontext():
        output = model(input_ids=ids, use_cache=False)
    if chunked:
        loss = chunked_cross_entropy(output, labels)
    else:
        from transformers.loss.loss_utils import ForCausalLMLoss

        loss = ForCausalLMLoss(output.logits, labels, output.logits.size(-1))
    del output  # torchtune's recipes `del logits` before backward
    return loss
