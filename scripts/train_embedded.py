#!/usr/bin/env python
"""Train jaxkv's embedded default model ("pycoder") from scratch on CPU.

No model hub is reachable where jaxkv is built, so the project trains and ships
its own tiny model. The corpus is text that every CPython installation carries:
the standard library's own ``.py`` sources (test suites, IDLE, site-packages,
codec tables and other non-code data left out).

Steps (all deterministic given the Python installation, fixed seeds and 2 threads):

1. Collect the stdlib sources in sorted path order; every 50th file (by sorted
   order) goes to the validation split.
2. Train a byte-level BPE tokenizer with ``tokenizers`` (no normalizer, so text,
   whitespace and indentation round-trip exactly). ``<|endoftext|>`` (id 0) is
   the only special token: BOS, EOS, pad and the document separator. The saved
   tokenizer prepends it to every encoded text (like Llama's BOS).
3. Train a tiny ``LlamaForCausalLM`` (grouped-query attention, tied embeddings)
   with AdamW and a warmup + cosine schedule on random 256-token windows of the
   concatenated ``<|endoftext|> doc <|endoftext|> doc ...`` stream.
4. Save an HF-format directory (config.json, generation_config.json,
   model.safetensors in float32, tokenizer.json, tokenizer_config.json), write
   ``docs/training_log.json`` and ``docs/training_loss.png``, and print samples.

Commands used for the shipped model: six runs, each continuing from the one before
(``--init-from``); all six are in README ("The embedded model") and in
``docs/training_log.json`` (``command``, and ``previous_runs``). The first:

    nice -n 10 python scripts/train_embedded.py --out jaxkv/_assets/pycoder --bf16 \
        --extra-train-dirs test --train-minutes 70 --steps 100000 --warmup 200 \
        --eval-every 250 --log-every 50

Runs 3 to 5 train on 512-token windows (``--context 512 --batch 8``); run 3 also on the
sources of installed packages (``--extra-train-packages jax numpy networkx matplotlib pip``).
Run 5 adds every function of the stdlib training files as its own document (``--function-docs``).
Run 7 (run 6 was not shipped) deepens run 5's 4 layers to 6 first (``--grow-layers 6``).

On an accelerator whose Python differs from this one (another stdlib), train on data made
here: ``--write-data DIR`` here, ``--data DIR --device cuda`` there (``scripts/device_train.sh``).

``--extra-train-dirs test`` adds the standard library's own test suite (753 files that
parse, 17 MB) to the training split only: the validation files and the tokenizer's
training text are the base corpus's, so the tokenizer is byte-identical to the one the
draft model (``train_draft.py``) shares. ``--train-minutes`` runs the cosine decay over
wall-clock time rather than a step count: the shipped model trained while other jobs
shared the two cores, so its step count (in ``docs/training_log.json``) depends on that
load, and a rerun gives a different model, not a bit-identical one. ``--bf16`` computes
under ``torch.autocast(bfloat16)`` (1.2x per step for this size on an AMX CPU; weights,
optimizer and the saved model stay float32). ``scripts/eval_embedded.py`` measures what
the result writes.

It needs torch, transformers, tokenizers, safetensors, numpy and matplotlib
(the ``bench`` and ``test`` extras).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

EOT = "<|endoftext|>"
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from stdlib_corpus import (  # noqa: E402
    EXCLUDED_DIRS,
    collect_extra,
    collect_packages,
    collect_sources,
    drop_overlapping,
    function_documents,
    split_files,
)

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="jaxkv/_assets/pycoder", help="output model directory")
    p.add_argument("--docs", default="docs", help="where training_log.json / training_loss.png go")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument(
        "--max-positions",
        type=int,
        default=None,
        help="the context the saved config declares (max_position_embeddings, the tokenizer's "
        "model_max_length); default --context: the positions the model was trained on, since past "
        "them its output falls apart, and jaxkv's CLI refuses a prompt + --max-new-tokens beyond it",
    )
    p.add_argument("--context", type=int, default=256, help="training window (tokens)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument(
        "--train-minutes",
        type=float,
        default=0.0,
        help="train for this many minutes of wall clock instead of a step count: after the warmup "
        "steps the cosine decay runs over the time left, so the schedule ends when the time does "
        "whatever the step rate (a shared machine's varies); --steps is then only an upper bound "
        "and --max-minutes is not used",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="run forward and backward under torch.autocast(bfloat16) (weights, optimizer state and the "
        "loss stay float32; the saved model is float32). On CPUs with AMX or AVX512-BF16 the matmuls are "
        "faster",
    )
    p.add_argument(
        "--extra-train-dirs",
        nargs="*",
        default=[],
        help="stdlib subfolders (e.g. 'test') whose sources are added to the training split only: the "
        "validation files and the tokenizer's training text stay the base corpus's",
    )
    p.add_argument(
        "--extra-train-packages",
        nargs="*",
        default=[],
        help="installed packages (import names, e.g. numpy jax) whose sources are added to the training "
        "split only, like --extra-train-dirs; the corpus record keeps their versions",
    )
    p.add_argument(
        "--function-docs",
        action="store_true",
        help="also train on every function of the stdlib training files as its own document, "
        "dedented to column 0 and followed by the end-of-text token (stdlib_corpus.function_documents): "
        "the shape of a held-out header's continuation, which whole files seldom show",
    )
    p.add_argument(
        "--init-from",
        default=None,
        help="an HF model directory written by this script: start from its weights (the architecture "
        "options are then read from its config.json) and carry its training log forward. The "
        "tokenizer this run trains must equal the directory's tokenizer.json byte for byte",
    )
    p.add_argument(
        "--grow-layers",
        type=int,
        default=None,
        help="with --init-from: deepen the model to this many layers before training, computing the same "
        "function at step 0 (grow_depth: each new layer is a copy of the one before it with its attention "
        "output and MLP down projections zeroed, so it adds nothing to the residual stream until trained)",
    )
    p.add_argument(
        "--write-data",
        default=None,
        help="write the tokenizer and token streams to this directory and stop (for --data on another machine)",
    )
    p.add_argument("--data", default=None, help="train on a directory written by --write-data instead of this stdlib")
    p.add_argument(
        "--unlikelihood-every",
        type=int,
        default=0,
        help="every K-th step also continues --ul-batch function headers of the training files with the "
        "model itself (--ul-temperature, --ul-tokens) and adds the sequence-level unlikelihood loss on "
        "the tokens that repeat an --ul-ngram of their continuation (scripts/unlikelihood.py); 0: off",
    )
    p.add_argument("--ul-ngram", type=int, default=8)
    p.add_argument("--ul-batch", type=int, default=16)
    p.add_argument("--ul-tokens", type=int, default=192)
    p.add_argument("--ul-temperature", type=float, default=0.2)
    p.add_argument("--ul-weight", type=float, default=1.0)
    p.add_argument(
        "--self-data",
        default=None,
        help="a token stream written by scripts/self_samples.py (the model's own functions that finished and "
        "parse, as function documents): --self-rows of every batch's rows are windows of it instead of the "
        "corpus (rejection-sampling fine-tuning)",
    )
    p.add_argument("--self-rows", type=int, default=0, help="rows of each batch taken from --self-data")
    p.add_argument("--device", default="cpu", help="torch device to train on (cpu, cuda)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=23.0,
        help="wall-clock budget for the whole run. The machine is shared, so step time varies; "
        "if the measured step time projects past the budget, the planned step count is cut so the "
        "cosine schedule still decays to its end in time (each cut is recorded in the log; "
        "with 0 the step count is never changed)",
    )
    args = p.parse_args(argv)
    if args.max_positions is None:
        args.max_positions = args.context
    if bool(args.self_data) != (args.self_rows > 0) or not 0 <= args.self_rows <= args.batch:
        p.error("--self-data and --self-rows go together, with 0 < --self-rows <= --batch")
    return args


# --------------------------------------------------------------------------- data


# ---------------------------------------------------------------------- tokenizer


def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    eot_id = tok.token_to_id(EOT)
    assert eot_id == 0, eot_id
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A",
        pair=f"{EOT} $A {EOT} $B:1",
        special_tokens=[(EOT, eot_id)],
    )
    return tok


def encode_stream(tok, texts, eot_id):
    """``<|endoftext|> doc <|endoftext|> doc ... <|endoftext|>`` as one uint16 array."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = []
    for enc in encs:
        parts.append([eot_id])
        parts.append(enc.ids)
    parts.append([eot_id])
    return np.concatenate([np.asarray(p, dtype=np.uint16) for p in parts])


def check_roundtrip(tok, texts):
    bad = 0
    for t in texts:
        if tok.decode(tok.encode(t).ids, skip_special_tokens=True) != t:
            bad += 1
    return bad


# -------------------------------------------------------------------------- model


def make_model(args, vocab_size, eot_id):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def prepare_corpus(args):
    """Tokenizer, token streams and a description of the corpus, from this Python's stdlib."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = collect_sources(stdlib)
    train_files, val_files = split_files(files)
    extra_files = collect_extra(stdlib, args.extra_train_dirs)
    package_files, package_versions = collect_packages(args.extra_train_packages)
    # No extra file may carry held-out code (a vendored copy of a validation module).
    extra_files, dropped = drop_overlapping(extra_files + package_files, val_files)
    corpus_sha = hashlib.sha256("".join(p + "\0" + t for p, t in files).encode()).hexdigest()
    n_bytes = {k: sum(len(t.encode()) for _, t in v) for k, v in (("train", train_files), ("val", val_files))}
    n_bytes["extra"] = sum(len(t.encode()) for _, t in extra_files)
    function_docs = function_documents(train_files) if args.function_docs else []
    n_bytes["function_docs"] = sum(len(t.encode()) for t in function_docs)
    print(f"stdlib {stdlib}: {len(train_files)} train files ({n_bytes['train']/1e6:.2f} MB), "
          f"{len(val_files)} val files ({n_bytes['val']/1e6:.2f} MB), {len(extra_files)} extra training "
          f"files from {args.extra_train_dirs + args.extra_train_packages} ({n_bytes['extra']/1e6:.2f} MB; "
          f"{len(dropped)} dropped for sharing code with a validation file)", flush=True)

    t0 = time.time()
    tok = train_tokenizer([t for _, t in train_files], args.vocab_size)
    eot_id = tok.token_to_id(EOT)
    bad = check_roundtrip(tok, [t for _, t in val_files])
    assert bad == 0, f"{bad} validation files do not round-trip through the tokenizer"
    train_ids = encode_stream(tok, [t for _, t in train_files + extra_files] + function_docs, eot_id)
    val_ids = encode_stream(tok, [t for _, t in val_files], eot_id)
    tok_time = time.time() - t0
    print(f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_ids)} train tokens "
          f"({(sum(n_bytes.values()) - n_bytes['val']) / len(train_ids):.2f} bytes/token; {len(function_docs)} function "
          f"documents added), {len(val_ids)} val tokens, "
          f"{tok_time:.1f}s", flush=True)
    corpus = {
        "stdlib": str(stdlib),
        "python": sys.version.split()[0],
        "train_files": len(train_files),
        "val_files": len(val_files),
        "val_file_names": [p for p, _ in val_files],
        "train_bytes": n_bytes["train"],
        "extra_train_dirs": args.extra_train_dirs,
        "extra_train_packages": package_versions,
        "extra_dropped_as_overlapping_val": dropped,
        "extra_train_files": len(extra_files),
        "extra_train_bytes": n_bytes["extra"],
        "function_docs": len(function_docs),
        "function_docs_bytes": n_bytes["function_docs"],
        "val_bytes": n_bytes["val"],
        "train_tokens": int(len(train_ids)),
        "val_tokens": int(len(val_ids)),
        "sha256": corpus_sha,
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "tokenizer_and_data_s": round(tok_time, 1),
    }
    return tok, train_ids, val_ids, corpus


DATA_FILES = ("tokenizer.json", "train_ids.npz", "val_ids.npz", "corpus.json")


def write_data(path, tok, train_ids, val_ids, corpus):
    """What ``--data`` reads: the tokenizer, both token streams (uint16, zlib-compressed: the
    device tool carries at most 64 MiB with the working tree) and the corpus record.

    A machine with another Python (the accelerator's has 3.12, this one 3.11) has another
    stdlib, so a run there trains on the data made here instead of its own.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    np.savez_compressed(path / "train_ids.npz", ids=train_ids)
    np.savez_compressed(path / "val_ids.npz", ids=val_ids)
    (path / "corpus.json").write_text(json.dumps(corpus, indent=1) + "\n")
    size = sum((path / f).stat().st_size for f in DATA_FILES)
    print(f"wrote {path}: {', '.join(DATA_FILES)} ({size/1e6:.1f} MB)", flush=True)


def load_data(path):
    from tokenizers import Tokenizer

    path = Path(path)
    missing = [f for f in DATA_FILES if not (path / f).exists()]
    if missing:
        raise SystemExit(f"--data {path}: missing {', '.join(missing)}; write it with --write-data {path}")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    with np.load(path / "train_ids.npz") as train, np.load(path / "val_ids.npz") as val:
        train_ids, val_ids = train["ids"], val["ids"]
    corpus = json.loads((path / "corpus.json").read_text())
    if (len(train_ids), len(val_ids)) != (corpus["train_tokens"], corpus["val_tokens"]):
        raise SystemExit(f"--data {path}: the token files do not have the lengths corpus.json records")
    print(f"data {path}: {len(train_ids)} train tokens, {len(val_ids)} val tokens "
          f"(made from the stdlib of Python {corpus['python']})", flush=True)
    return tok, train_ids, val_ids, corpus


def load_init(args, tok, eot_id):
    """The model in ``args.init_from`` and the training log that made it (or None).

    The run continues that model's training on the same token ids, so the tokenizer trained
    here (deterministic from the corpus) has to be the one saved with it.
    """
    from transformers import LlamaForCausalLM

    src = (REPO / args.init_from).resolve()  # an absolute path stays itself
    saved = (src / "tokenizer.json").read_text()
    if saved != tok.to_str(pretty=True):
        raise SystemExit(
            f"--init-from {src}: its tokenizer.json differs from the tokenizer trained on this corpus, "
            "so its token ids would not mean the same text; train from scratch (no --init-from) or use "
            "the Python whose stdlib made that model"
        )
    model = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    cfg = model.config
    for name, value in (("hidden", cfg.hidden_size), ("layers", cfg.num_hidden_layers),
                        ("heads", cfg.num_attention_heads), ("kv_heads", cfg.num_key_value_heads),
                        ("intermediate", cfg.intermediate_size)):
        setattr(args, name, value)
    cfg.max_position_embeddings = args.max_positions  # this run's declared context, not the source's
    prior = find_prior_log(src, [REPO / args.docs / "training_log.json", REPO / "docs" / "training_log.json"])
    print(f"init from {src} (prior run: {prior['command'] if prior else 'no log of it found'})", flush=True)
    return model, prior


SHIPPED_MODEL = REPO / "jaxkv" / "_assets" / "pycoder"
SHIPPED_LOG = REPO / "docs" / "training_log.json"


def weights_sha256(model_dir: Path) -> str:
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()


def find_prior_log(src: Path, log_paths: list[Path]) -> dict | None:
    """The training log (of those at ``log_paths`` that exist, first match) of the run that
    wrote the weights in ``src``, else None.

    A log that records ``model.weights_sha256`` matches the weights it names, wherever they
    were copied. Older logs record only the directory the run wrote (``args.out``, e.g.
    ``/tmp/run7/pycoder``); such a log matches that directory, and the repository's
    ``docs/training_log.json`` also matches the shipped model it documents
    (``jaxkv/_assets/pycoder``, copied from the run's ``--out``).
    """
    src = Path(src).resolve()
    digest = weights_sha256(src) if (src / "model.safetensors").exists() else None
    for log_path in dict.fromkeys(Path(p) for p in log_paths):
        if not log_path.exists():
            continue
        log = json.loads(log_path.read_text())
        recorded = log.get("model", {}).get("weights_sha256")
        if recorded is not None:
            matches = recorded == digest
        else:
            matches = (REPO / log["args"]["out"]).resolve() == src or (
                src == SHIPPED_MODEL.resolve() and log_path.resolve() == SHIPPED_LOG.resolve()
            )
        if matches:
            return log
    return None


def grow_depth(model, n_layers: int) -> list[int]:
    """Deepens a ``LlamaForCausalLM`` in place to ``n_layers`` layers, leaving its function unchanged.

    The new layers are spread evenly: each follows a source layer and starts as a copy of it
    (attention, MLP, norms) whose ``o_proj`` and ``down_proj`` are zero, so its residual
    update is exactly 0 and the logits do not move until training gives those projections
    weight; the copied projections give the new layer working features from the first step.
    Returns, for each layer of the grown model, the source layer it was copied from.
    """
    import copy

    layers = model.model.layers
    n_src = len(layers)
    if n_layers < n_src:
        raise SystemExit(f"--grow-layers {n_layers}: the model already has {n_src} layers; "
                         "grow_depth only adds layers (give a count above it)")
    extra = n_layers - n_src
    grown, origin = [], []
    for i, layer in enumerate(layers):
        grown.append(layer)
        origin.append(i)
        # copies after source layer i: spread the extra layers evenly over the source ones
        for _ in range((i + 1) * extra // n_src - i * extra // n_src):
            new = copy.deepcopy(layer)
            with torch.no_grad():
                new.self_attn.o_proj.weight.zero_()
                new.mlp.down_proj.weight.zero_()
            grown.append(new)
            origin.append(i)
    model.model.layers = torch.nn.ModuleList(grown)
    for idx, layer in enumerate(grown):
        layer.self_attn.layer_idx = idx  # the KV cache is indexed by it
    model.config.num_hidden_layers = n_layers
    return origin


def unlikelihood_prompts(corpus) -> list[str]:
    """The function headers (as ``eval_embedded.py`` cuts them) of the training files of this
    Python's stdlib: the unlikelihood loss's prompts, never a validation file's or a tuning
    package's. The corpus (``--data``) must come from this Python's stdlib."""
    import sysconfig

    from eval_embedded import function_headers
    from stdlib_corpus import collect_sources, split_files

    if corpus.get("python") and corpus["python"] != platform.python_version():
        raise SystemExit(f"--unlikelihood-every: the data was made from Python {corpus['python']}'s stdlib and "
                         f"this is {platform.python_version()}: its training files may not be the data's")
    train_files, _ = split_files(collect_sources(Path(sysconfig.get_paths()["stdlib"])))
    return [header for _, _, header in function_headers(train_files)]


def load_self_data(path, window: int) -> np.ndarray:
    """The token stream of ``scripts/self_samples.py`` (``--self-data``)."""
    with np.load(path) as f:
        ids = f["ids"]
    if len(ids) <= window:
        raise SystemExit(f"--self-data {path}: {len(ids)} tokens, fewer than one window of {window}")
    print(f"self data {path}: {len(ids)} tokens", flush=True)
    return ids


def training_windows(rng, train_ids, self_ids, batch: int, self_rows: int, window: int) -> np.ndarray:
    """``[batch, window]`` int64: random windows of the corpus, the last ``self_rows`` of them
    from ``self_ids`` (the model's own parsing functions) instead."""
    rows = []
    for stream, n in ((train_ids, batch - self_rows), (self_ids, self_rows)):
        for s in rng.integers(0, len(stream) - window, size=n) if n else ():
            rows.append(stream[s : s + window])
    return np.stack(rows).astype(np.int64)


def lr_at(step, args, progress=None):
    """Linear warmup over ``args.warmup`` steps, then cosine decay to ``min_lr_ratio``.

    The decay's ``progress`` (0 to 1) is by steps, or, with ``--train-minutes``, the share of
    the training time spent, given by the caller.
    """
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if progress is None:
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cos)


def lm_loss(model, batch):
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, windows, batch_size):
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        b = windows[i : i + batch_size]
        total += lm_loss(model, b).item() * len(b)
        n += len(b)
    model.train()
    return total / n


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# ------------------------------------------------------------------------ outputs


def save_hf_dir(model, tok, out: Path, args, eot_id):
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file():
            stale.unlink()
    model = model.to(device="cpu", dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        do_sample=False,
        max_new_tokens=128,
    )
    model.save_pretrained(out, safe_serialization=True)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        model_max_length=args.max_positions,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out)
    # transformers 5 writes its own backend name here; the generic fast-tokenizer class
    # loads under transformers 4.x as well as 5.x.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.pop("backend", None)
    tc["add_bos_token"] = False  # tokenizer.json's post-processor already prepends <|endoftext|>
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    # tokenizer.json written by tokenizers itself is the canonical file.
    tok.save(str(out / "tokenizer.json"))


PROMPTS = ["def fibonacci(", "import os\n", "class Stack:"]


@torch.no_grad()
def samples(model, tok, eot_id, max_new_tokens=96, seed=0):
    model.eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        greedy = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        torch.manual_seed(seed)
        sampled = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40
        )
        out.append(
            {
                "prompt": prompt,
                "greedy": tok.decode(greedy[0].tolist(), skip_special_tokens=True),
                "sampled_t0.8_k40_seed0": tok.decode(sampled[0].tolist(), skip_special_tokens=True),
            }
        )
    return out


def plot(history, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(h["step"], h["train_loss"]) for h in history if h.get("train_loss") is not None]
    va = [(h["step"], h["val_loss"]) for h in history if h.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(*zip(*tr), label="train (mean over log interval)", lw=1.4)
    ax.plot(*zip(*va), "o-", label="validation (held-out stdlib files)", lw=1.4, ms=3.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(argv)
    args_given = dict(vars(args))
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    niceness = os.nice(0)
    cmd = ("" if niceness == 0 else f"nice -n {niceness} ") + "python " + shlex.join(
        [os.path.relpath(sys.argv[0], os.getcwd())] + sys.argv[1:]
    )
    print(f"command: {cmd}", flush=True)

    if args.data:
        tok, train_ids, val_ids, corpus = load_data(args.data)
    else:
        tok, train_ids, val_ids, corpus = prepare_corpus(args)
    eot_id = tok.token_to_id(EOT)
    if args.write_data:
        write_data(args.write_data, tok, train_ids, val_ids, corpus)
        return
    device = torch.device(args.device)

    T = args.context + 1
    n_val = min(args.eval_windows, len(val_ids) // T)
    val_starts = np.linspace(0, len(val_ids) - T, n_val).astype(np.int64)
    val_windows = torch.from_numpy(np.stack([val_ids[s : s + T] for s in val_starts]).astype(np.int64)).to(device)

    prior_log = None
    grown_from = None
    if args.grow_layers is not None and not args.init_from:
        raise SystemExit("--grow-layers deepens a trained model: give --init-from too "
                         "(to train a deeper model from scratch, use --layers)")
    if args.init_from:
        model, prior_log = load_init(args, tok, eot_id)
        if args.grow_layers is not None and args.grow_layers != args.layers:
            grown_from = {"layers": args.layers, "copied_from": grow_depth(model, args.grow_layers)}
            print(f"grew {args.layers} -> {args.grow_layers} layers (each copied from layer "
                  f"{grown_from['copied_from']}, new ones with zeroed output projections)", flush=True)
            args.layers = args.grow_layers
    else:
        model = make_model(args, tok.get_vocab_size(), eot_id)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    opt = torch.optim.AdamW(
        param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8
    )

    history = []
    if args.init_from:
        # where the starting weights stand, on the same validation windows
        history.append({"step": 0, "val_loss": evaluate(model, val_windows, args.batch), "elapsed_s": 0.0})
        print(f"step     0  val {history[0]['val_loss']:.4f} (starting weights)", flush=True)
    schedule_cuts = []
    running, running_n = 0.0, 0
    stopped_early = None
    planned_steps = args.steps
    marks = [(0, time.time())]  # (steps done, time) every 25 steps, for the step-time estimate
    t_train = marks[0][1]
    ul_headers = unlikelihood_prompts(corpus) if args.unlikelihood_every else None
    self_ids = load_self_data(args.self_data, T) if args.self_data else None
    ul_gen = torch.Generator().manual_seed(args.seed)
    ul_running = {"loss": 0.0, "candidates": 0, "tokens": 0, "steps": 0}
    model.train()
    step = 0
    t_decay = None  # when the warmup ended (--train-minutes)
    progress = None
    best = None  # the weights at the lowest validation loss so far
    while step < args.steps:
        if args.train_minutes > 0 and step >= args.warmup:
            if t_decay is None:
                t_decay = time.time()
            progress = (time.time() - t_decay) / max(1.0, args.train_minutes * 60 - (t_decay - t_train))
        lr = lr_at(step, args, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = torch.from_numpy(training_windows(rng, train_ids, self_ids, args.batch, args.self_rows, T)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = lm_loss(model, batch)
        total = loss
        if args.unlikelihood_every and step % args.unlikelihood_every == 0:
            import unlikelihood

            picked = [ul_headers[i] for i in rng.choice(len(ul_headers), args.ul_batch, replace=False)]
            ul_out, ul_mask, width, kept = unlikelihood.continuations(
                model, tok, picked, eot_id=eot_id, max_new_tokens=args.ul_tokens,
                temperature=args.ul_temperature, generator=ul_gen, device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                ul, n_cand, n_tok = unlikelihood.unlikelihood_loss(model, ul_out, ul_mask, width, kept, args.ul_ngram)
            if ul is not None:
                total = loss + args.ul_weight * ul
                ul_running["loss"] += float(ul.detach())
            ul_running["candidates"] += n_cand
            ul_running["tokens"] += n_tok
            ul_running["steps"] += 1
        opt.zero_grad(set_to_none=True)
        total.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        running += loss.detach()  # summed on the device: no host sync per step
        running_n += 1
        step += 1

        done = step
        now = time.time()
        if done % 25 == 0:
            marks.append((done, now))
        last = done == args.steps or (progress is not None and progress >= 1.0)
        if args.train_minutes <= 0 and args.max_minutes > 0 and done >= 50 and done % 25 == 0 and not last:
            # seconds per step over (up to) the last 200 steps
            (s0, t0_), (s1, t1_) = marks[max(0, len(marks) - 9)], marks[-1]
            rate = (t1_ - t0_) / (s1 - s0)
            left_s = args.max_minutes * 60 - (now - t_start) - 45  # saving + samples
            if (args.steps - done) * rate > left_s:
                new_steps = max(done + 25, done + int(left_s / rate))
                if new_steps < args.steps:
                    cut = {"at_step": done, "from_steps": args.steps, "to_steps": new_steps,
                           "sec_per_step": round(rate, 3), "elapsed_s": round(now - t_start, 1)}
                    schedule_cuts.append(cut)
                    print(f"time budget: cutting planned steps {args.steps} -> {new_steps} "
                          f"({rate:.2f}s/step)", flush=True)
                    args.steps = new_steps
        over_time = args.train_minutes <= 0 and (now - t_start) / 60 > args.max_minutes + 1.5
        if done % args.log_every == 0 or last or over_time:
            rec = {
                "step": done,
                "train_loss": float(running) / running_n,
                "lr": lr,
                "grad_norm": float(gnorm),
                "tokens_seen": done * args.batch * args.context,
                "elapsed_s": round(time.time() - t_train, 1),
            }
            running, running_n = 0.0, 0
            if ul_running["steps"]:
                # the share of the model's own continuations (training headers) that repeat an n-gram
                rec["ul_loss"] = ul_running["loss"] / ul_running["steps"]
                rec["ul_repeat_share"] = ul_running["candidates"] / max(1, ul_running["tokens"])
                ul_running = {"loss": 0.0, "candidates": 0, "tokens": 0, "steps": 0}
            if done % args.eval_every == 0 or last or over_time:
                rec["val_loss"] = evaluate(model, val_windows, args.batch)
                if best is None or rec["val_loss"] < best["val_loss"]:
                    # a copy on the device (a few MB): the run keeps its best weights if the
                    # validation loss turns up late (many epochs over the data on a GPU)
                    best = {"step": done, "val_loss": rec["val_loss"],
                            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
            history.append(rec)
            print(
                f"step {done:5d}/{args.steps}  train {rec['train_loss']:.4f}"
                + (f"  val {rec['val_loss']:.4f}" if "val_loss" in rec else "")
                + (f"  ul {rec['ul_loss']:.3f} repeats {rec['ul_repeat_share']:.3f}" if "ul_loss" in rec else "")
                + f"  lr {lr:.2e}  {rec['elapsed_s']:.0f}s",
                flush=True,
            )
        if over_time and not last:
            stopped_early = f"stopped at step {done} of {args.steps}: over --max-minutes {args.max_minutes}"
            print(stopped_early, flush=True)
            break
        if last:
            break
    train_time = time.time() - t_train
    steps_done = history[-1]["step"]
    restored = None
    final_val = [h["val_loss"] for h in history if "val_loss" in h][-1]
    # An unlikelihood run trades some validation loss for fewer repeats by design: it keeps its
    # last weights (scripts/eval_embedded.py --prompt-set tune decides whether they ship).
    if best is not None and best["val_loss"] < final_val and not args.unlikelihood_every:
        model.load_state_dict(best["state"])
        restored = {"step": best["step"], "val_loss": best["val_loss"], "last_val_loss": final_val}
        print(f"validation loss rose to {final_val:.4f}: saving the weights of step {best['step']} "
              f"(val {best['val_loss']:.4f})", flush=True)
        final_val = best["val_loss"]
    best = None

    out = REPO / args.out  # an absolute path stays itself
    save_hf_dir(model, tok, out, args, eot_id)
    smp = samples(model, tok, eot_id)
    for s in smp:
        print(f"--- {s['prompt']!r} greedy:\n{s['greedy']}\n--- sampled:\n{s['sampled_t0.8_k40_seed0']}\n", flush=True)

    weight_bytes = (out / "model.safetensors").stat().st_size
    last_train = [h["train_loss"] for h in history if "train_loss" in h][-4:]
    log = {
        "command": cmd,
        "cwd_note": "run from the repository root",
        "args": args_given,
        "python": sys.version,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "stdlib": corpus["stdlib"],
        "corpus": {k: v for k, v in corpus.items() if k != "stdlib"},
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "eot_token": EOT, "eot_id": eot_id},
        "model": {
            "architecture": "LlamaForCausalLM",
            "parameters": n_params,
            "config": json.loads((out / "config.json").read_text()),
            "weights_file_bytes": weight_bytes,
            "weights_sha256": weights_sha256(out),  # find_prior_log matches a continued run's start by it
            **({"grown_from": grown_from} if grown_from else {}),
        },
        "training": {
            "steps_planned": planned_steps,
            "train_minutes": args.train_minutes,
            "schedule_cuts_for_time_budget": schedule_cuts,
            "steps_done": steps_done,
            "stopped_early": stopped_early,
            "tokens_seen": steps_done * args.batch * args.context,
            "epochs_over_train_tokens": steps_done * args.batch * args.context / len(train_ids),
            "train_wall_s": round(train_time, 1),
            "total_wall_s": round(time.time() - t_start, 1),
            "final_train_loss_mean_last_100_steps": float(np.mean(last_train)),
            "final_val_loss": final_val,
            "restored_best_weights": restored,
        },
        "history": history,
        "samples": smp,
    }
    if args.self_data:
        made = Path(args.self_data).with_suffix(".json")  # what scripts/self_samples.py recorded
        log["self_data"] = {"tokens": int(len(self_ids)), "rows_per_batch": args.self_rows,
                            **({k: v for k, v in json.loads(made.read_text()).items() if k != "examples"}
                               if made.exists() else {})}
    if args.init_from:
        # The runs that made the starting weights, newest first, each without its own samples.
        prior = dict(prior_log or {})
        earlier = prior.pop("previous_runs", [])
        prior.pop("samples", None)
        log["init_from"] = args.init_from
        log["previous_runs"] = ([prior] if prior else []) + earlier
    docs = REPO / args.docs
    docs.mkdir(parents=True, exist_ok=True)
    title = (f"pycoder: {n_params/1e6:.2f}M-param Llama on CPython stdlib, "
             + ("continued:" if args.init_from else "") + "\n"
             + f"{steps_done} steps x {args.batch}x{args.context} tokens, {train_time/60:.1f} min wall, "
             + ("2 shared CPU cores" if device.type == "cpu" else torch.cuda.get_device_name(device)))
    (docs / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    try:  # the log is written first: a plotting failure must not lose it
        plot(history, docs / "training_loss.png", title)
    except Exception as e:  # noqa: BLE001
        print(f"training_loss.png not drawn: {type(e).__name__}: {e}", flush=True)
    print(f"saved {out} ({weight_bytes/1e6:.2f} MB weights); total {time.time()-t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
