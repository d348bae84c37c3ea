"""Trainer vs a bare PyTorch loop on the same model, batches and optimizer: the tokens/s ratio.

Both run in this process on the device the Trainer picked (CUDA when there is one, else the CPU), alternating in
rounds so that machine noise hits them alike. The bare loop is what one would write by hand: autocast, forward,
cross-entropy, backward, clip, AdamW step, reading the loss every `--steps` steps as the Trainer logs it.

    python benchmarks/titan_overhead.py [--rounds 5] [--steps 10] [--out outputs/bench_titan]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from titan.config import parse_args
from titan.models.llama3 import Transformer
from titan.tools.logging import init_logger
from titan.trainer import Trainer


def bare_loop(model_args, batches, steps, lr, dtype, device: torch.device):
    with torch.device("meta"):
        model = Transformer(model_args)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    it = iter(batches)

    def run():
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(steps):
            inputs, labels = (t.to(device, non_blocking=True) for t in next(it))
            with torch.autocast(device.type, dtype=dtype):
                logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += labels.numel()
        loss.item()  # waits for the device, as the Trainer's logged step does
        return tokens / (time.perf_counter() - t0)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per round and contender")
    parser.add_argument("--out", default="outputs/bench_titan")
    args = parser.parse_args()
    init_logger()
    out = Path(args.out)
    total = (args.rounds + 1) * args.steps
    config = parse_args(["--training.steps", str(total), "--metrics.log_freq", str(args.steps),
                         "--validation.enable", "false", "--job.dump_folder", str(out / "trainer"),
                         "--lr_scheduler.warmup_steps", "0"])
    trainer = Trainer(config)
    loader = trainer.spec.build_dataloader(config, 0, 1, trainer.tokenizer, "train")
    bare = bare_loop(trainer.model_args, loader, args.steps, config.optimizer.lr, torch.bfloat16, trainer.device)

    def run_trainer():
        target = trainer.step + args.steps
        config.training.steps = target
        t0 = time.perf_counter()
        start_step = trainer.step
        trainer.train()
        tokens = (trainer.step - start_step) * trainer.global_batch_size * config.training.seq_len
        return tokens / (time.perf_counter() - t0)

    run_trainer()
    bare()  # warm-up of both
    ratios, ours, base = [], [], []
    for r in range(args.rounds):
        pair = (run_trainer(), bare()) if r % 2 == 0 else tuple(reversed((bare(), run_trainer())))
        ours.append(pair[0])
        base.append(pair[1])
        ratios.append(pair[0] / pair[1])
        print(f"round {r}: trainer {pair[0]:,.0f} tok/s  bare {pair[1]:,.0f} tok/s  ratio {ratios[-1]:.3f}")
    trainer.close()
    result = {
        "trainer_tps_median": statistics.median(ours),
        "bare_tps_median": statistics.median(base),
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "device": torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "tokens_per_step": trainer.global_batch_size * config.training.seq_len,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"tokens/s ratio trainer/bare: {result['ratio_median']:.3f} (median of {args.rounds}; target >= 0.97)")


if __name__ == "__main__":
    main()
