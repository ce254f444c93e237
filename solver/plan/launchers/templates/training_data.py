# fitplan: template only
"""The training data of the emitted script: --data's tokens cut into rows of the planned sequence length, or, without
--data, random tokens (a smoke test of the plan). The second part of train_fitplan.py, after train_fitplan.py's own
lines."""
# ANN001/ANN201: emitted script code, without annotations (see this package's docstring).
# ruff: noqa: ANN001, ANN201

import json
import os

import torch
import torch.distributed as dist

# fitplan: end template only


def token_batches(vocab, args, device, *, size, replica, replicas):
    """Batches of `size` sequences (input ids, labels) for data-parallel replica `replica` of `replicas`: its rows of
    --data (`data_rows`), or, without --data, random tokens: a smoke test of the plan, whose loss means nothing."""
    if args.data is None:
        if dist.get_rank() == 0:
            print("no --data: training on random tokens (a smoke test of the plan, not training)", flush=True)
        generator = torch.Generator(device="cpu").manual_seed(1000 + replica)
        while True:
            ids = torch.randint(0, vocab, (size, args.seq_len), generator=generator)
            yield ids.to(device), ids.to(device)
    rows = data_rows(args, replica, replicas)
    while True:
        ids = torch.tensor([next(rows) for _ in range(size)], dtype=torch.long)
        yield ids.to(device), ids.to(device)


def data_rows(args, replica, replicas):
    """This replica's rows of --seq-len tokens: the documents' tokens joined end to end and cut into rows (TRL's
    "wrapped" packing), row i going to replica i mod replicas; from the start again when the data ends."""
    while True:
        pending, index, mine = [], 0, 0
        for tokens in documents(args):
            pending.extend(tokens)
            rows = len(pending) // args.seq_len
            for r in range(rows):
                if (index + r) % replicas == replica:
                    mine += 1
                    yield pending[r * args.seq_len:(r + 1) * args.seq_len]
            index += rows
            pending = pending[rows * args.seq_len:]
        if mine == 0:
            raise SystemExit(f"--data {args.data}: fewer than {replicas} rows of {args.seq_len} tokens")


def documents(args):
    """Each document's token ids: a tokenized dataset folder's input_ids (datasets' save_to_disk), or JSON Lines
    records holding input_ids, or text for the model's tokenizer (an end-of-sequence token after each)."""
    if os.path.isdir(args.data):
        from datasets import load_from_disk

        data = load_from_disk(args.data)
        for record in data["train"] if hasattr(data, "keys") else data:
            yield list(record["input_ids"])
        return
    tokenizer = None
    with open(args.data, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "input_ids" in record:
                yield list(record["input_ids"])
            elif "text" in record:
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(args.model)
                end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
                yield tokenizer(record["text"], add_special_tokens=True)["input_ids"] + end
            else:
                raise SystemExit(f"{args.data}:{number}: a record needs input_ids or text")
