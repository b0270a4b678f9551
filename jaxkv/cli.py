"""The ``jaxkv`` command line: stream text from a checkpoint through a jaxkv cache.

    jaxkv generate "def fibonacci(" [--model PATH] [--max-new-tokens N] [--temperature T]
                   [--top-k K] [--top-p P] [--min-p M] [--repetition-penalty R]
                   [--presence-penalty A] [--frequency-penalty F] [--seed S] [--prompt-cache FILE]

With no ``--model`` it uses the embedded model shipped inside the package (a tiny
Llama trained by ``scripts/train_embedded.py`` on the Python standard library). Errors
(bad flags, a malformed checkpoint, a prompt that is not UTF-8, a cache larger than free
memory) are one line on stderr and exit status 2; no traceback. A reader that closes the
pipe early (``| head``) ends the run quietly with status 1, as Python does on EPIPE.

Compiled programs are kept in a persistent XLA compilation cache, so a second run starts
decoding without compiling: ``$JAXKV_COMPILATION_CACHE`` if set, else
``$XDG_CACHE_HOME/jaxkv/xla`` (``~/.cache/jaxkv/xla``). ``JAXKV_COMPILATION_CACHE=0``
turns it off; a cache directory set for JAX itself (``JAX_COMPILATION_CACHE_DIR``) is used
as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from importlib import resources
from typing import Any, TextIO

from jaxkv import _env

EMBEDDED_MODEL = "pycoder"

# Cache positions are int32.
_MAX_CAPACITY = 2**31 - 1
# Share of free memory the cache may take; the rest is for activations and the runtime.
_MEMORY_FRACTION = 0.9
# Decode steps per device call (jaxkv.stream's tokens_per_call): text arrives in bursts of
# this many tokens, a few milliseconds apart, too fast to see.
_TOKENS_PER_CALL = 16


def compilation_cache_dir() -> str | None:
    """Where the CLI keeps compiled programs; None when ``JAXKV_COMPILATION_CACHE=0``."""
    setting = os.environ.get("JAXKV_COMPILATION_CACHE", "").strip()
    if _env.is_off(setting):
        return None
    if setting and not _env.is_on(setting):  # a directory (an on spelling: the default one, not ./true)
        return os.path.abspath(os.path.expanduser(setting))
    return _env.home_cache("jaxkv", "xla")  # None without a home directory: no caching


def _use_compilation_cache() -> None:
    """Turns on JAX's persistent compilation cache in :func:`compilation_cache_dir`.

    Compiling the prefill and the decode loop is most of a cold run's time before the first
    token (about 2.5 s of 3.5 s here); loading them from the cache takes milliseconds. JAX
    skips programs that compile in under a second by default: these two are just above or
    below that line, so every program is cached. An unwritable directory only means no
    caching (JAX warns and goes on).
    """
    import jax

    if jax.config.jax_compilation_cache_dir:  # the user's own JAX setting wins
        return
    directory = compilation_cache_dir()
    if directory is None:
        return
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return
    if not os.access(directory, os.W_OK | os.X_OK):
        # (JAX would warn at every program it could not write: 14 two-line warnings, some
        # in the middle of the generated text)
        _note(f"[jaxkv] compilation cache {directory} is not writable: programs are compiled on every run "
              "(set JAXKV_COMPILATION_CACHE to a writable directory, or 0)")
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class Detokenizer:
    """Token ids in, printable text out, one id at a time, without decoding the whole output
    again for each id (that costs O(n) per token, O(n^2) per run).

    Decodes a window of the ids not yet printed plus the ids of context before them, and
    prints what the window adds to the context's text. ``prompt_ids`` (already printed by the
    caller) seed that context: SentencePiece-style decoders (Metaspace, or Llama-2/Mistral's
    ``Replace("▁", " ")`` + ``Strip``) drop the leading space of the first token decoded,
    so the first new token decoded alone would lose the space that separates it from the
    prompt. Text that ends in an incomplete multi-byte character (U+FFFD) is held back until
    the character completes; what is held back when the stream ends is never printed.
    """

    _CONTEXT = 4  # prompt ids kept as context (fewer where they start inside a character)

    def __init__(self, tokenizer, prompt_ids=()):
        self._tokenizer = tokenizer
        context = [int(i) for i in list(prompt_ids)[-self._CONTEXT :]]
        # a context that starts inside a multi-byte character (byte-fallback pieces) decodes
        # to U+FFFD there, which the window's text would never start with: drop those ids
        while context and tokenizer.decode(context).startswith("\ufffd"):
            context = context[1:]
        if context and tokenizer.decode(context).endswith("\ufffd"):
            context = []  # the prompt ends inside a character: no context (as before)
        self._ids: list[int] = context
        self._start = 0  # the window: ids[_start:] are decoded for each new id
        self._printed = len(context)  # ids[_start:_printed] are the context whose text is already out

    def push(self, token: int) -> str:
        """The new text that ``token`` completes ("" while a character is incomplete)."""
        self._ids.append(token)
        window = self._ids[self._start :]
        text = self._tokenizer.decode(window)
        if text.endswith("\ufffd"):
            return ""
        before = self._tokenizer.decode(window[: self._printed - self._start])
        if not text.startswith(before):
            return ""
        self._start, self._printed = self._printed, len(self._ids)
        return text[len(before) :]


def embedded_model_path() -> str:
    """Directory of the embedded default checkpoint."""
    return str(resources.files("jaxkv") / "_assets" / EMBEDDED_MODEL)


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse printing its errors as one line (``--top-k abc`` printed the whole usage block,
    9 lines, where every other bad value is one line; review 59); exit status 2 as before."""

    def error(self, message: str):
        _note(f"{self.prog}: error: {message} (see {self.prog} --help)")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="jaxkv", description="Key/value-cached decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a continuation of a prompt")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--model", default=None, help="HF-format checkpoint directory (default: the embedded model)")
    gen.add_argument("--max-new-tokens", type=int, default=120, help="tokens to generate (default 120)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 for no limit (default 40)")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus mass; 1.0 for no limit (default 0.95)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="drop tokens less likely than M times the most likely one; 0 for no limit (default 0)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="HF's repetition penalty on tokens of the prompt and the output; > 1 discourages repeats, "
                     "1 is off (default 1)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="subtracted from the logit of every token already generated; 0 is off (default 0)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="subtracted once per time a token was generated; 0 is off (default 0)")
    gen.add_argument("--seed", type=int, default=0, help="PRNG seed, an integer in [0, 2**32) (default 0)")
    gen.add_argument(
        "--prompt-cache", metavar="FILE", default=None,
        help="reuse the prompt's cache saved in FILE when model and prompt prefix match (only the rest is "
        "prefilled); otherwise save it there after prefill",
    )
    # the options whose value may be a negative number (see _attach_negative_values)
    parser.numeric_flags = {a.option_strings[-1] for a in gen._actions if a.type in (int, float) and a.option_strings}
    parser.long_flags = {o for a in gen._actions for o in a.option_strings if o.startswith("--")}
    return parser


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _config_value(path: str, name: str, key: str) -> tuple[str, Any]:
    """``(file, value of key)`` from a JSON file of the checkpoint; None if the file or the key
    is absent. A file that is there but unreadable, not JSON or not a JSON object is an error:
    skipping it would drop what it says (a chat model's end-of-turn stop ids)."""
    file = os.path.join(path, name)
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return file, None
    except (OSError, ValueError) as e:
        raise CliError(f"{file}: not a readable JSON file ({type(e).__name__}: {e}); fix or remove it") from None
    if not isinstance(data, dict):
        raise CliError(f"{file}: expected a JSON object (keys and values), got a {type(data).__name__}")
    return file, data.get(key)


def _sampling_config(args: argparse.Namespace):
    from jaxkv.sampling import SamplingConfig

    # argparse's float() accepts "inf" and "nan"; neither is a usable setting.
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise CliError(f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:  # also rejects nan
        raise CliError(f"--top-p must be in (0, 1] (1 for no limit), got {args.top_p}")
    if args.top_k < 0:
        raise CliError(f"--top-k must be >= 0 (0 for no limit), got {args.top_k}")
    options = {"--min-p": args.min_p, "--repetition-penalty": args.repetition_penalty,
               "--presence-penalty": args.presence_penalty, "--frequency-penalty": args.frequency_penalty}
    for flag, value in options.items():
        if not math.isfinite(value):
            raise CliError(f"{flag} must be a finite number, got {value}")
    try:
        return SamplingConfig(
            temperature=args.temperature, top_k=args.top_k or None, top_p=None if args.top_p == 1.0 else args.top_p,
            min_p=args.min_p or None, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        )
    except ValueError as e:  # the config's own message names the field; the flag is its dashed form
        field = str(e).split(" ", 1)[0]
        raise CliError(f"--{field.replace('_', '-')} {str(e).split(' ', 1)[1]}") from None


def _free_memory(device) -> tuple[int | None, str]:
    """Bytes free for new arrays on ``device`` and where that figure comes from."""
    stats = device.memory_stats()  # accelerators: the allocator's figures; CPU: None
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.platform.upper()} memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory"
    except (OSError, ValueError, AttributeError):
        return None, ""


def _check_memory(loaded, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuses a run whose cache cannot fit, before XLA tries to allocate it.

    XLA's out-of-memory error is a long traceback that arrives after compiling; the cache's
    size is known exactly from its abstract shape, so it is checked up front.
    """
    import jax
    from flax import nnx

    from jaxkv.generation import bucket_length

    capacity = bucket_length(prompt_tokens) + max_new_tokens
    if capacity > _MAX_CAPACITY:
        raise CliError(
            f"--max-new-tokens {max_new_tokens} asks for a cache of {capacity} tokens; positions are int32, "
            f"so prompt plus new tokens can be at most {_MAX_CAPACITY}: lower --max-new-tokens"
        )
    shapes = jax.eval_shape(lambda: loaded.model.init_cache(1, capacity))
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(loaded.model)))
    free, where = _free_memory(jax.devices()[0])
    if free is None or cache_bytes <= _MEMORY_FRACTION * free:
        return
    per_token = cache_bytes / capacity
    fits = max(int(_MEMORY_FRACTION * free / per_token) - (capacity - max_new_tokens), 0)
    raise CliError(
        f"--max-new-tokens {max_new_tokens} needs a {_human_bytes(cache_bytes)} cache ({capacity} tokens) "
        f"besides the {_human_bytes(weight_bytes)} of weights, but only {_human_bytes(free)} of {where} is free; "
        f"lower --max-new-tokens to at most about {fits}"
    )


def _check_prompt(prompt: str) -> None:
    # Bytes that are not UTF-8 reach sys.argv as lone surrogates (surrogateescape); the
    # tokenizer and the terminal would both fail on them later.
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raw = os.fsencode(prompt)
        raise CliError(
            f"the prompt is not valid UTF-8 (byte {raw[err.start]:#04x} at position {err.start}); "
            "pass UTF-8 text"
        ) from None


def run_generate(args: argparse.Namespace, out: TextIO) -> None:
    # Imports are deferred so that `jaxkv --help` and argument errors are instant.
    import jax
    import jax.numpy as jnp

    try:
        from jaxkv._checks import model_vocab_size
        from jaxkv.generation import NAN_TOKEN, stream
        from jaxkv.models import CheckpointError, from_pretrained
    except ImportError as err:  # a core-only install (jax alone): no models
        raise CliError(f"jaxkv generate needs the models extra ({err}): pip install 'jaxkv[models]'") from None

    # The switches the run will read deep inside attention: a bad value is this command's
    # one-line error now, not a traceback after the prompt was echoed.
    from jaxkv import _kernels
    from jaxkv.attention import pallas_gpu

    try:
        _kernels.switched_off()
        pallas_gpu.switch_mode()
    except ValueError as err:
        raise CliError(str(err)) from None

    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    # jax.random.key keeps 32 bits of the seed (without x64): a wider one (or a negative one)
    # would silently give another seed's text (2**32 + 1 gave seed 1's), as PagedEngine refuses too.
    if not 0 <= args.seed < 2**32:
        raise CliError(f"--seed must be an integer in [0, 2**32), got {args.seed}")
    sampling = _sampling_config(args)
    _check_prompt(args.prompt)
    if args.model is not None and not args.model.strip():
        # `--model "$MODEL"` with MODEL unset ran the embedded model as if none was asked for
        raise CliError("--model is empty; give a checkpoint directory, or leave --model out for the embedded model")
    path = args.model if args.model is not None else embedded_model_path()
    try:
        loaded = from_pretrained(path)
    except (CheckpointError, TypeError) as err:
        raise CliError(str(err)) from None
    if loaded.tokenizer is None:
        raise CliError(f"{path}: no tokenizer.json, so the prompt cannot be encoded")
    ids = loaded.tokenizer.encode(args.prompt).ids
    if not ids:
        raise CliError("the prompt encodes to zero tokens; give some text")
    vocab = model_vocab_size(loaded.model)
    if vocab is not None and max(ids) >= vocab:
        raise CliError(
            f"{path}: the tokenizer gave id {max(ids)} for the prompt, but the model's vocabulary is [0, {vocab}): "
            "tokenizer.json and config.json (vocab_size) come from different models"
        )
    _, context = _config_value(path, "config.json", "max_position_embeddings")
    if context is not None and len(ids) + args.max_new_tokens > context:
        raise CliError(
            f"prompt ({len(ids)} tokens) plus --max-new-tokens ({args.max_new_tokens}) exceeds the model's "
            f"context of {context} tokens; shorten the prompt or lower --max-new-tokens"
        )
    _check_memory(loaded, len(ids), args.max_new_tokens)
    eos = _eos_ids(path, model_vocab_size(loaded.model))
    _use_compilation_cache()  # only now: a run refused above leaves JAX's settings alone
    if jax.default_backend() == "cpu":
        # A new machine's first run: the kernel's compiler (25-45 s) runs in the background
        # and this run takes the XLA loop, instead of a silent wait before the first token.
        if _kernels.start_background_build():
            _note("[jaxkv] the CPU attention kernel is being built in the background (once per machine, "
                  "about a minute); this run uses the slower XLA path")
        else:
            # Loaded now (it is built), or why not (no compiler, a build that failed): one line
            # before the text, not a warning in the middle of its first line.
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _kernels.available()
            for warning in caught:
                _note("[jaxkv] " + " ".join(str(warning.message).split()))

    generated = 0
    detokenizer = Detokenizer(loaded.tokenizer, ids)
    start = None
    step = 0
    cache_bytes = 0
    tokens_stream = _stream_maker(args, stream)(
        loaded.model,
        jnp.asarray([ids], jnp.int32),
        args.max_new_tokens,
        sampling=sampling,
        key=jax.random.key(args.seed),
        eos_token_id=list(eos) or None,
        tokens_per_call=_TOKENS_PER_CALL,
    )
    # Echoed only now: the prompt cache's stderr line (and any error) comes before the
    # text, not in the middle of its first line on a terminal showing both streams.
    out.write(args.prompt)
    out.flush()
    for step, tokens in enumerate(tokens_stream):
        if step == 0:
            cache = tokens_stream.cache
            cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
        if step == 1:
            # Step 0 is the prefill call, steps 1.._TOKENS_PER_CALL the first decode call:
            # both include compiling, so the rate below counts later calls' tokens only.
            start = time.perf_counter()
        token = int(tokens[0])
        if token == NAN_TOKEN:  # the model's logits were NaN: no token to decode
            out.write("\n")
            out.flush()
            raise CliError(
                f"{path}: the model produced NaN logits (at new token {generated + 1}); its weights or config hold "
                "a NaN, an inf or a value that overflows (e.g. rope_theta)"
            )
        if token in eos:
            break
        generated += 1
        text = detokenizer.push(token)
        if text:
            out.write(text)
            out.flush()
    elapsed = time.perf_counter() - start if start is not None else 0.0
    decode_tokens = step - _TOKENS_PER_CALL
    # The first two calls include compiling: a run that ends within them has no decode rate
    # to show (it printed "nan tokens/s" before, which read as a failure).
    if decode_tokens > 0 and elapsed > 0:
        rate = f"{decode_tokens / elapsed:.1f} tokens/s (decode)"
    else:
        rate = (f"decode rate not measured (it needs {_TOKENS_PER_CALL + 2} or more new tokens: the first "
                f"{_TOKENS_PER_CALL + 1} come from the calls that compile)")
    out.write("\n")
    out.write(
        f"[jaxkv] prompt {len(ids)} tokens | new {generated} tokens | {rate} | "
        f"cache {_human_bytes(cache_bytes)} ({type(cache).__name__}) | model {os.path.basename(os.path.normpath(path))}\n"
    )
    out.flush()


def _stream_maker(args: argparse.Namespace, stream):
    """``stream``, or with ``--prompt-cache`` one that restores and saves the prompt's cache."""
    if args.prompt_cache is None:
        return stream
    from jaxkv.persist import CacheFileError, PromptCacheStream

    def make(*stream_args, **stream_kwargs):
        try:
            made = PromptCacheStream(args.prompt_cache, *stream_args, **stream_kwargs)
        except CacheFileError as err:
            message = str(err)
            if "delete" not in message.lower() and os.path.isfile(args.prompt_cache):
                # the CLI saves only when the file lacks the prompt: a damaged one stays until removed
                message += f" Delete {args.prompt_cache} (or use another --prompt-cache path) to start afresh."
            raise CliError(message) from None
        _note(f"[jaxkv] prompt cache {args.prompt_cache}: {made.restored} of {made.prompt_tokens} prompt tokens "
              "restored")
        return _SavingErrors(made)

    return make


class _SavingErrors:
    """A prompt-cache stream whose failed save (raised while iterating) is a CliError."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __iter__(self):
        from jaxkv.persist import CacheFileError

        try:
            yield from self._inner
        except CacheFileError as err:
            raise CliError(str(err)) from None


def _note(message: str) -> None:
    """A line on stderr; nothing when stderr is closed (``2>&-``: print would write it into
    the generated text on stdout)."""
    if sys.stderr is not None:
        print(message, file=sys.stderr)


def _eos_ids(path: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """Every stop id of the checkpoint (``eos_token_id``: one id or a list, as chat models
    that end a turn with one of several ids have it), from generation_config.json, else
    config.json; () when neither names one. Each must lie in ``[0, vocab_size)``."""
    for name in ("generation_config.json", "config.json"):
        file, eos = _config_value(path, name, "eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not ids:
            continue
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise CliError(
                    f"{file}: key 'eos_token_id' must be a token id (an integer >= 0) or a list of them, got {eos!r}"
                )
            if vocab_size is not None and i >= vocab_size:
                raise CliError(
                    f"{file}: key 'eos_token_id' names id {i}, outside the model's vocabulary [0, {vocab_size})"
                )
        return tuple(ids)
    return ()


class _OutputError(Exception):
    """Writing the generated text failed (other than a closed pipe)."""


class _Output:
    """``stream``'s write and flush, with an OSError from them (a full disk, an I/O error)
    raised as :class:`_OutputError`; a closed pipe stays a BrokenPipeError."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        self._call(self.stream.write, text)

    def flush(self) -> None:
        self._call(self.stream.flush)

    @staticmethod
    def _call(fn, *args):
        try:
            fn(*args)
        except BrokenPipeError:
            raise
        except OSError as err:
            raise _OutputError(err) from None
        except UnicodeEncodeError as err:
            raise _OutputError(
                f"stdout's encoding ({err.encoding}) cannot write {err.object[err.start:err.end]!r}; "
                "set PYTHONIOENCODING=utf-8"
            ) from None


def _attach_negative_values(argv: list[str], numeric: set[str], options: set[str] = frozenset()) -> list[str]:
    """``--flag -1e-3`` as ``--flag=-1e-3``: argparse takes a value that starts with ``-`` for a
    number only in its plain forms (``-1``, ``-.5``), so ``-1e-3`` or ``-inf`` after a numeric
    option read as another option ("expected one argument") instead of the value."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        if arg.startswith("--") and arg not in options:  # argparse's abbreviations (--presence)
            matches = [o for o in options if o.startswith(arg)]
            arg = matches[0] if len(matches) == 1 else arg
        if arg in numeric and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            try:
                float(argv[i + 1])
            except ValueError:
                pass
            else:
                out.append(f"{arg}={argv[i + 1]}")
                i += 2
                continue
        out.append(arg)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(_attach_negative_values(sys.argv[1:] if argv is None else list(argv), parser.numeric_flags,
                                                     parser.long_flags))
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        _note("jaxkv: error: stdout is closed; nowhere to write the text")
        return 1
    try:
        if args.command == "generate":
            run_generate(args, _Output(sys.stdout))
        return 0
    except BrokenPipeError:
        # The reader went away (`jaxkv generate ... | head`): stop quietly, as Python's docs
        # advise (signal module, "Note on SIGPIPE"): point stdout at devnull so that the flush
        # at interpreter exit cannot raise again, and exit 1 as Python does on EPIPE.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
            pass
        return 1
    except CliError as err:
        _note(f"jaxkv: error: {err}")
        return 2
    except _OutputError as err:
        # stdout full (`> /dev/full`) or failing: one line, not a traceback; stdout then points
        # at devnull so that the flush at interpreter exit cannot raise again.
        _note(f"jaxkv: error: cannot write the output: {err}")
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # stdout without a file descriptor
            pass
        return 1
    except KeyboardInterrupt:
        _note("\njaxkv: interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
