"""Generation with a Hyena LM: exact prompt prefill, then one token at a time through an online engine.

python -m lcsm.generate --prompt "The history of" [--checkpoint outputs/hyena_debug/checkpoint/step-200]
    [--config configs/lcsm/hyena_debug.toml] [--engine flash|lazy|eager|recompute|all] [--max-new-tokens 64]
    [--decode native|compiled|eager]
    [--section.key value ...]   (titan overrides the model was trained with, e.g. --model.dim 32)
python -m lcsm.generate --hf DIR --prompt ACGT... [--engine ...] [--max-new-tokens N]
    (a HyenaDNA checkpoint folder, see lcsm.hf; the prompt in HyenaDNA's characters)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lcsm.inference.decode import DECODES, default_decode, new_decode_state
from lcsm.inference.engines import ENGINES
from lcsm.inference.tau import TAUS
from lcsm.model.hyena import HyenaLM
from titan.tools.cli import UserError, entry_point, report_done, run


@torch.no_grad()
def generate(model: nn.Module, prompt_BP: torch.Tensor, max_new_tokens: int, engine: str = "flash",
             temperature: float = 0.0, generator: torch.Generator | None = None, decode: str = "eager",
             **flash_options) -> torch.Tensor:
    """Prompt (B, P) -> prompt followed by max_new_tokens tokens (B, P + max_new_tokens); greedy at temperature 0.
    The model: a HyenaLM or a HyenaDNA; the engine's filters cover the positions the generation uses."""
    B, P = prompt_BP.shape
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if P + max_new_tokens - 1 > model.args.max_seq_len:
        raise ValueError(
            f"prompt ({P}) + max_new_tokens ({max_new_tokens}) needs {P + max_new_tokens - 1} positions but the "
            f"filters cover max_seq_len = {model.args.max_seq_len}; shorten the prompt or generate fewer tokens"
        )
    state = new_decode_state(model, engine, B, decode=decode, length=P + max_new_tokens - 1, **flash_options)
    logits = state.prefill(prompt_BP)[:, -1]
    new = []
    for i in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            token = logits.argmax(-1)
        new.append(token)
        if i < max_new_tokens - 1:
            logits = state.step(token)
    return torch.cat([prompt_BP, torch.stack(new, 1)], 1)


def load_model(config_path: str, checkpoint: str, overrides: list[str]):
    """Tokenizer and model from a titan config (and a titan checkpoint folder, if given)."""
    from lcsm.model.spec import hyena_flavors, update_model_args
    from titan.components.checkpoint import read_checkpoint
    from titan.components.data import build_tokenizer
    from titan.config import parse_args

    job_config = parse_args(["--config", config_path, *overrides])
    if job_config.model.name != "hyena" or job_config.model.flavor not in hyena_flavors:
        raise UserError(f"--config {config_path} names {job_config.model.name}/{job_config.model.flavor}; "
                        f"lcsm.generate runs hyena flavors ({', '.join(hyena_flavors)}): give a hyena config")
    tokenizer = build_tokenizer(job_config)
    args = hyena_flavors[job_config.model.flavor]
    args = update_model_args(dataclasses.replace(args, **job_config.model.args), job_config, tokenizer)
    model = HyenaLM(args)
    model.init_weights()
    if checkpoint:
        # The identity a training run records, so a checkpoint of another model or size is named as such.
        identity = {"model": "hyena", "flavor": job_config.model.flavor, "model_args": repr(args)}
        state = {"model": model.state_dict()}
        read_checkpoint(Path(checkpoint), state, identity)
        model.load_state_dict(state["model"])
    return tokenizer, model.eval()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m lcsm.generate", description=__doc__.split("\n")[0])
    p.add_argument("--prompt", default="The history of")
    p.add_argument("--config", default="configs/lcsm/hyena_debug.toml", help="titan TOML naming the hyena flavor "
                   "and tokenizer")
    p.add_argument("--checkpoint", default="", help="a titan checkpoint folder (.../checkpoint/step-N); "
                   "without it the weights are random")
    p.add_argument("--hf", default="", help="a HyenaDNA checkpoint folder (published or -hf layout) instead of a "
                   "titan config and checkpoint")
    p.add_argument("--engine", default="flash", help=f"one of {', '.join(ENGINES)}, or all (checks that the "
                   "greedy tokens agree)")
    p.add_argument("--tau", default="hybrid", help=f"flash's tile implementation: {', '.join(TAUS)}")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--decode", choices=list(DECODES), help="the decode step outside the long convolutions: eager, "
                   "compiled by AOTInductor (built once per machine and shape, about 30 s) or native (in C, built "
                   "in about a second; the default where a C compiler is, with float32 or float64 weights on a "
                   "CPU, else eager)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_known_args(argv)


@entry_point
def main(argv: list[str]) -> int:
    began = time.perf_counter()
    args, overrides = parse_args(argv)
    engines = list(ENGINES) if args.engine == "all" else [args.engine]
    problems = [
        (args.engine not in ENGINES and args.engine != "all", f"--engine must be one of {', '.join(ENGINES)}, all"),
        (args.tau not in TAUS, f"--tau must be one of {', '.join(TAUS)}"),
        (args.max_new_tokens < 1, "--max-new-tokens must be >= 1"),
        (args.temperature < 0, "--temperature must be >= 0"),
        (not args.hf and not Path(args.config).is_file(), f"--config {args.config} is not a file; give a hyena TOML"),
        (args.checkpoint and not Path(args.checkpoint).is_dir(), f"--checkpoint {args.checkpoint} is not a folder"),
        (args.hf and (args.checkpoint or overrides), "--hf loads a HyenaDNA checkpoint by itself; drop --checkpoint "
         "and the --section.key overrides"),
        (args.hf and args.decode not in (None, "eager"), f"--decode {args.decode} folds a Hyena LM's weights; a "
         "HyenaDNA checkpoint decodes eagerly: drop --decode"),
    ]
    for bad, message in problems:
        if bad:
            raise UserError(message)
    if not args.prompt:
        raise UserError("--prompt is empty; give at least one character")
    torch.manual_seed(args.seed)
    if args.hf:
        from lcsm import hf
        from lcsm.model.hyenadna import CharacterTokenizer

        model, tokenizer = hf.load(args.hf), CharacterTokenizer()
        prompt = torch.tensor([tokenizer.encode(args.prompt)])
    else:
        tokenizer, model = load_model(args.config, args.checkpoint, overrides)
        if not args.checkpoint:
            print("note: no --checkpoint, so the weights are random and the text is noise", file=sys.stderr)
        prompt = torch.tensor([tokenizer.encode(args.prompt, bos=True, eos=False)])
    if prompt.shape[1] + args.max_new_tokens - 1 > model.args.max_seq_len:
        raise UserError(f"prompt ({prompt.shape[1]} tokens) + --max-new-tokens {args.max_new_tokens} exceed the "
                        f"model's max_seq_len {model.args.max_seq_len}; shorten the prompt or generate fewer tokens")
    decode = args.decode or default_decode(model)
    results, ms_per_token = {}, {}
    for engine in engines:
        options = {"tau": args.tau} if engine == "flash" else {}
        start = time.perf_counter()
        tokens = generate(model, prompt, args.max_new_tokens, engine, args.temperature,
                          torch.Generator().manual_seed(args.seed), decode=decode, **options)
        ms_per_token[engine] = (time.perf_counter() - start) / args.max_new_tokens * 1e3
        results[engine] = tokens
        print(f"[{engine}] {ms_per_token[engine]:.1f} ms/token")
    first = results[engines[0]]
    print(tokenizer.decode(first[0].tolist()))
    same = all(torch.equal(t, first) for t in results.values())
    if len(engines) > 1:
        print(f"tokens identical across {', '.join(engines)}: {same}")
    figure = ", ".join(f"{e} {ms:.1f} ms/token" for e, ms in ms_per_token.items())
    report_done(f"{args.max_new_tokens} tokens with {', '.join(engines)}", time.perf_counter() - began,
                figure + (f", identical: {same}" if len(engines) > 1 else ""), "the text above (no files)")
    return 0 if same else 1


if __name__ == "__main__":
    run(main)
