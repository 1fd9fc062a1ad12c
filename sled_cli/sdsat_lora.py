"""`sled sdsat train --mode lora`: generate the target's greedy continuations of corpus prompts,
train the SAT LoRA adapter on them (sdsat.lora), write the run's folder and plot."""
from __future__ import annotations

from pathlib import Path

from sdsat.corpus import load_documents
from sdsat.distill import DistillSpec, build_distill_set
from sdsat.lora import LoraTrainConfig, check_start, train_sat_lora
from sdsat.train import LOG_FILE, PLOT_FILE, Checkpoints, TrainingFolder
from sled.progress import plain_line
from sled.wire.fingerprint import fingerprint_tokenizer
from sled_cli.sdsat_train import finish, load, on_step, plot_log, progress_bar
from verify_server.sdsat import load_adapter

DEFAULT_LORA_LR = 2e-3


def train_lora(args, console) -> int:
    config = LoraTrainConfig(
        slots=args.slots, rank=args.rank, alpha=args.alpha, steps=args.steps, batch=args.batch,
        cuts=args.cuts, lr=args.lr or DEFAULT_LORA_LR, embedding_lr=args.embedding_lr,
        seed=args.seed, eval_every=args.eval_every or max(1, args.steps // 20),
        save_every=args.save_every)
    heldout = max(1, round(args.prompts * args.heldout))
    if heldout >= args.prompts:
        raise ValueError(f"--prompts {args.prompts} with --heldout {args.heldout} leaves nothing to "
                         "train on")
    start = _start(args.init_adapter, config)
    documents = load_documents(args.corpus)
    model, tokenizer = load(args.model, args.dtype)
    folder = TrainingFolder(Path(args.out), {
        "base_model": args.model, "mode": "lora", "slots": config.slots, "corpus": args.corpus,
        "labels": "target greedy continuation", "prompts": args.prompts,
        "prompt_len": args.prompt_len, "prompts_at": args.prompts_at,
        "init_adapter": args.init_adapter, "new_tokens": args.new_tokens, "rank": config.rank,
        "alpha": config.alpha, "cuts": config.cuts, "seed": config.seed, "batch": config.batch,
        "lr": config.lr, "embedding_lr": config.embedding_lr,
        "tokenizer": fingerprint_tokenizer(tokenizer)})
    checkpoint_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else folder.out / "checkpoint"
    data = _distill(args, console, model, tokenizer, documents, checkpoint_dir)
    train, held = data.split(heldout)
    seen = args.steps * config.batch * min(config.cuts, data.new_tokens - config.slots)
    console.print(f"{args.model}: {len(train.sequences)} training and {len(held.sequences)} "
                  f"held-out greedy sequences ({data.prompt_len} + {data.new_tokens} tokens); "
                  f"{config.slots} slots, LoRA r={config.rank}; {seen} training cuts "
                  f"({seen * config.slots} SAT-slot labels)")
    with progress_bar("SAT LoRA training") as progress:
        checkpoints = Checkpoints(checkpoint_dir, args.resume, folder.on_checkpoint)
        spec, log = train_sat_lora(model, train, held, config, start, checkpoints,
                                   on_step(progress, config.steps))
    folder.metadata.update(training_cuts=seen, generated_tokens=data.new_tokens * len(data.sequences))
    adapter = folder.save(spec, log, config, {"train": len(train.sequences),
                                              "heldout": len(held.sequences)}, model, tokenizer)
    plot = plot_log(folder.out / PLOT_FILE, log, f"SAT LoRA training: {args.model}, "
                    f"{config.slots} slots, r={config.rank}, {args.corpus} (self-distilled)")
    return finish(args, console, checkpoint_dir, log, config.slots, [adapter, folder.out / LOG_FILE, plot])


def _distill(args, console, model, tokenizer, documents, checkpoint_dir: Path):
    """The greedy continuations, generated (or continued from the checkpoint folder's copy)."""
    with progress_bar("greedy continuations") as progress:
        task = progress.add_task("distill", total=args.prompts, status="")

        def on_batch(done: int, total: int) -> None:
            progress.update(task, completed=done, status=f"{done} of {total} prompts")
            plain_line(f"greedy continuations: {done} of {total} prompts")

        spec = DistillSpec(args.prompt_len, args.new_tokens, args.prompts, args.seed,
                           args.prompts_at)
        data = build_distill_set(model, tokenizer, documents, spec,
                                 cache=checkpoint_dir / "distill.pt", on_batch=on_batch)
    console.print(f"{len(data.sequences)} prompts continued greedily "
                  f"({len(data.sequences) * data.new_tokens} target tokens)")
    return data


def _start(path: str | None, config):
    """The adapter --init-adapter names, loaded and checked against the run (None without the
    flag)."""
    if path is None:
        return None
    if not Path(path).is_file():
        raise ValueError(f"--init-adapter {path}: no such file")
    return check_start(load_adapter(path), config)
