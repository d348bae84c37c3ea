"""Tokenizers and text loaders shared by every language model trained with titan."""

from __future__ import annotations

from pathlib import Path

from titan.components.data.text import (
    PackedTextLoader,
    StreamingTextLoader,
    corpus_id,
    load_documents,
    open_hub_stream,
    split_documents,
    tokenized_corpus,
)
from titan.components.data.tokenizer import (
    BPETokenizer,
    Llama3Tokenizer,
    Tokenizer,
    corpus_bpe_tokenizer,
    hf_folder_tokenizer,
)
from titan.tools.cli import UserError

# Data sets that TorchTitan's configs name and that titan does not ship.
TORCHTITAN_DATASETS = {"c4_test": "TorchTitan's 2K-document test set", "c4": "allenai/c4 (177M documents)"}


def check_dataset(training) -> None:
    """A data set name this run cannot read (one of TorchTitan's, or a misspelling): one line naming the fix."""
    if training.dataset in TORCHTITAN_DATASETS and not training.dataset_path:
        raise UserError(f"training.dataset {training.dataset!r} ({TORCHTITAN_DATASETS[training.dataset]}) is not "
                        "shipped with titan: use --training.dataset wiki_offline (bundled Wikipedia leads), or "
                        "--training.dataset_path with local copies of its json/parquet files")
    # A name that is neither the bundled corpus nor a hub id ("owner/name") is a misspelling.
    if not training.dataset_path and training.dataset != "wiki_offline" and "/" not in training.dataset:
        raise UserError(f"training.dataset {training.dataset!r} is neither the bundled 'wiki_offline' nor a "
                        "Hugging Face hub id (owner/name); fix the name, or set training.dataset_path to your files")


def tokenizer_kind(job_config) -> str:
    kind = job_config.model.tokenizer
    if kind == "auto":
        if job_config.model.hf_assets_path:
            return "hf"
        return "bpe" if job_config.model.flavor in ("debug", "debugmodel") else "llama3"
    return kind


def build_tokenizer(job_config) -> Tokenizer:
    """The configured tokenizer; the BPE is trained on the training split of the corpus and cached."""
    check_dataset(job_config.training)
    kind = tokenizer_kind(job_config)
    if kind == "hf":
        return hf_folder_tokenizer(Path(job_config.model.hf_assets_path))
    if kind == "llama3":
        return Llama3Tokenizer()
    training = job_config.training
    if not training.dataset_path and training.dataset != "wiki_offline":
        raise UserError(f"the corpus BPE tokenizer is trained on a local corpus, not on the stream "
                         f"{training.dataset!r}; use --model.tokenizer llama3")
    return corpus_bpe_tokenizer(
        lambda: split_documents(load_documents(training), training.validation_fraction, "train"),
        corpus_id(training),
        job_config.model.bpe_vocab_size,
    )


def build_text_dataloader(job_config, dp_rank: int, dp_degree: int, tokenizer: Tokenizer, split: str = "train"):
    """A stateful loader of (inputs, labels) token blocks for this data-parallel rank."""
    training = job_config.training
    check_dataset(training)
    if not training.dataset_path and training.dataset != "wiki_offline":
        stream = open_hub_stream(training.dataset, "train" if split == "train" else "validation")
        return StreamingTextLoader(stream, tokenizer, training.text_field, training.seq_len,
                                   training.local_batch_size, dp_rank, dp_degree)
    tok_id = f"{tokenizer_kind(job_config)}:{tokenizer.vocab_size}:{job_config.model.bpe_vocab_size}"
    tok_id += f":{tokenizer.identity}" if tokenizer.identity else ""
    if tokenizer_kind(job_config) == "bpe":
        tok_id += f":{corpus_id(training)}"
    tokens = tokenized_corpus(training, tokenizer, tok_id, split)
    return PackedTextLoader(
        tokens,
        seq_len=training.seq_len,
        local_batch_size=training.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=job_config.debug.seed,
        shuffle=split == "train",
        infinite=split == "train",
    )


__all__ = ["BPETokenizer", "Llama3Tokenizer", "PackedTextLoader", "StreamingTextLoader", "Tokenizer",
           "build_text_dataloader", "build_tokenizer"]
