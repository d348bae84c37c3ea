"""Tokenizers: the official Llama 3 tiktoken model, and a small byte-level BPE trained on the corpus."""

from __future__ import annotations

import abc
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterable
from pathlib import Path

from titan.tools.agreement import built_once
from titan.tools.cli import UserError

# Meta's Llama 3 pre-tokenizer split pattern.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


class Tokenizer(abc.ABC):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    """None for a model trained without one (Qwen): documents are then separated by EOS alone."""
    eos_id: int
    identity: str = ""
    """A hash of the file a folder's tokenizer was read from, so cached token ids of two tokenizers never mix."""

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._encode_batch([text])[0]
        return self._head(bos) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list[list[int]]:
        head, tail = self._head(bos), [self.eos_id] if eos else []
        return [head + ids + tail for ids in self._encode_batch(texts)]

    def _head(self, bos: bool) -> list[int]:
        return [self.bos_id] if bos and self.bos_id is not None else []

    @abc.abstractmethod
    def _encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...


def llama3_tokenizer_path() -> Path:
    spec = importlib.util.find_spec("llama_models")
    path = Path(spec.submodule_search_locations[0]) / "llama3" / "tokenizer.model" if spec else None
    if path is None or not path.is_file():
        raise UserError(
            "the Llama 3 tokenizer file is missing; install it with: pip install 'llama-models==0.3.0' "
            "(or pip install -e '.[data]')"
        )
    return path


class Llama3Tokenizer(Tokenizer):
    """The official 128,256-token Llama 3 tokenizer (128,000 BPE ranks + 256 special tokens)."""

    NUM_RESERVED_SPECIAL = 256

    def __init__(self, path: Path | None = None):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(str(path or llama3_tokenizer_path()))
        names = [BOS, EOS, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
                 "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
        names += [f"<|reserved_special_token_{2 + i}|>" for i in range(self.NUM_RESERVED_SPECIAL - len(names))]
        special = {name: len(ranks) + i for i, name in enumerate(names)}
        self.model = tiktoken.Encoding("llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                       special_tokens=special)
        self.vocab_size = len(ranks) + len(special)
        self.bos_id, self.eos_id = special[BOS], special[EOS]

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.model.encode_ordinary_batch(texts, num_threads=2)

    def decode(self, ids: Iterable[int]) -> str:
        return self.model.decode(list(ids))


class BPETokenizer(Tokenizer):
    """A byte-level BPE (HF `tokenizers`) with BOS/EOS; small vocabularies keep tiny models cheap."""

    def __init__(self, path: Path, bos: str | None = BOS, eos: str = EOS, declared: tuple[str, ...] = ()):
        """`bos` None: the model has no begin token. `declared`: special tokens tokenizer_config.json names; those
        tokenizer.json lacks are appended after its vocabulary, as TorchTitan and transformers do (TorchTitan's own
        test tokenizer declares its BOS/EOS only there)."""
        from tokenizers import Tokenizer as HFTokenizer

        self.model = HFTokenizer.from_file(str(path))
        missing = [t for t in dict.fromkeys(declared) if self.model.token_to_id(t) is None]
        if missing:
            self.model.add_special_tokens(missing)
        self.vocab_size = self.model.get_vocab_size()
        self.bos_id = self.model.token_to_id(bos) if bos is not None else None
        self.eos_id = self.model.token_to_id(eos)
        if (bos is not None and self.bos_id is None) or self.eos_id is None:
            raise UserError(f"{path} has no {bos if self.bos_id is None else eos} token; name the begin/end "
                             "tokens in tokenizer_config.json (bos_token, eos_token)")

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.model.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.model.decode(list(ids), skip_special_tokens=True)

    @staticmethod
    def train(texts: list[str], vocab_size: int, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BOS, EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        tok.save(str(path))


def _special_token(config: dict, key: str) -> str | None:
    """tokenizer_config.json stores a special token as a string or as {"content": ...}."""
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


def hf_folder_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model folder: tokenizer.json (HF tokenizers), else Meta's
    original/tokenizer.model (tiktoken)."""
    folder = Path(folder)
    tokenizer: Tokenizer
    if (folder / "tokenizer.json").is_file():
        path = folder / "tokenizer.json"
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        bos, eos = _special_token(config, "bos_token"), _special_token(config, "eos_token")
        added = [t.get("content") for t in config.get("added_tokens_decoder", {}).values() if isinstance(t, dict)]
        # An explicit null bos_token (Qwen's folders) means the model was trained without one.
        begin = None if "bos_token" in config and bos is None else bos or BOS
        tokenizer = BPETokenizer(path, begin, eos or EOS, tuple(t for t in (bos, eos, *added) if t))
    elif (folder / "original" / "tokenizer.model").is_file():
        path = folder / "original" / "tokenizer.model"
        tokenizer = Llama3Tokenizer(path)
    else:
        raise UserError(f"model.hf_assets_path {folder} holds neither tokenizer.json nor "
                                "original/tokenizer.model; download the model's tokenizer there, or pass "
                                "--model.hf_assets_path '' to use model.tokenizer")
    tokenizer.identity = hashlib.sha1(path.read_bytes()).hexdigest()[:16]
    return tokenizer


def cache_dir() -> Path:
    root = os.environ.get("TITAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "titan"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def corpus_bpe_tokenizer(texts_fn, corpus_id: str, vocab_size: int) -> BPETokenizer:
    """Loads the BPE trained on this corpus from the cache, training it first (once per cache folder: each node's
    own, or a shared TITAN_CACHE_DIR) if needed; a failure on any rank stops every rank in the same line."""
    key = hashlib.sha1(f"{corpus_id}|{vocab_size}".encode()).hexdigest()[:16]
    path = built_once(cache_dir, f"bpe-{vocab_size}-{key}.json",
                      lambda tmp: BPETokenizer.train(texts_fn(), vocab_size, tmp))
    return BPETokenizer(path)
