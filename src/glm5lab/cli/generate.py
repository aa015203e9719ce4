"""`glm5lab generate`: load a checkpoint and continue a prompt, plain or MTP-speculative.

The command body behind `glm5lab.cli` (its flags' help says what they take; --model is resolved as
`glm5lab.checkpoints.export.resolve_checkpoint`); the work is `glm5lab.generate` (`glm5lab.infer.generate`).
What only the command knows (the folder, config, tokenizer, the prompt and --stop texts, option combinations)
is checked before the model is loaded; the values `glm5lab.generate` takes (sampling numbers, lengths, token
ids, the MTP layer) are checked by it alone, and its ValueError is the command's one-line error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from glm5lab import validate
from glm5lab.config import ModelConfig
from glm5lab.infer import AUTO_CHUNK, DEFAULT_PREFILL_CHUNK, DENSE_PREFILL_CHUNK, SPECULATIVE

REPLACEMENT_CHAR = "\ufffd"
DEFAULT_DRAFT_STEPS = 3


def add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="continue a prompt with a trained or downloaded model (plain or MTP-speculative)",
        description="Load a model and continue a prompt with the KV-cached decoder, streaming the text to "
        "stdout; a statistics line (new tokens, decode tokens/s, prefill time; with --speculative the "
        "acceptance length and the acceptance rate per draft position) goes to stderr at the end. "
        "Greedy by default.")
    p.add_argument("--model", metavar="DIR", required=True,
                   help="a `glm5lab train` run folder (its latest checkpoint is used), a checkpoint folder, or "
                   "an HF GLM-5 folder (config.json + *.safetensors, model_type glm_moe_dsa)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt text (needs a tokenizer)")
    prompt.add_argument("--prompt-ids", dest="prompt_ids", metavar='"ID ID ..."',
                        help="the prompt as token ids separated by spaces or commas, e.g. \"1 2 3\" (no tokenizer "
                        "needed; without one the output is printed as ids)")
    p.add_argument("--tokenizer", metavar="FILE", help="a tokenizer.json, or a folder holding one (default: the "
                   "checkpoint folder's tokenizer.json)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=64, metavar="N",
                   help="generate at most N tokens (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-k", dest="top_k", type=int, metavar="K",
                   help="sample only from the K most likely tokens (with --temperature > 0)")
    p.add_argument("--top-p", dest="top_p", type=float, metavar="P",
                   help="sample only from the smallest set of tokens with probability mass >= P, 0 < P <= 1 "
                   "(with --temperature > 0)")
    p.add_argument("--seed", type=int, metavar="S", help="seed for sampling (default: a fresh random seed)")
    p.add_argument("--stop", nargs="+", action="extend", metavar="TEXT_OR_ID",
                   help="end generation after emitting one of these tokens: a token id (an integer), or a text "
                   "that is one token of the tokenizer (e.g. '<|endoftext|>'); the stop token is output too. "
                   "Default: none (run to --max-new-tokens)")
    p.add_argument("--speculative", choices=SPECULATIVE[1:],
                   help="speculative decoding: draft with the model's MTP layer, verify them in one forward; "
                   "the output distribution is unchanged (greedy: the same tokens as without it)")
    p.add_argument("--draft-steps", dest="draft_steps", type=int, metavar="N",
                   help=f"tokens drafted per round with --speculative (default {DEFAULT_DRAFT_STEPS})")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"],
                   help="weight and cache dtype (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--index-cache-dtype", dest="index_cache_dtype", choices=["auto", "fp8"], default="auto",
                   help="dtype of the cached DSA indexer keys: auto = the cache's (--dtype), fp8 = float8_e4m3fn with "
                   "one fp32 scale per token, as DeepSeek-V3.2 serves them (132 instead of 512 bytes per token per "
                   "indexer layer at 128-wide keys in fp32; the keys the indexer scores are rounded, docs/inference.md)")
    p.add_argument("--prefill-chunk", dest="prefill_chunk", type=prefill_chunk_arg, default=AUTO_CHUNK,
                   metavar="N", help=f"prefill the prompt in pieces of N tokens, or \"{AUTO_CHUNK}\" (the default: "
                   f"{DENSE_PREFILL_CHUNK} when every layer is dense MLA full attention, no DSA nor window: each chunk "
                   f"then costs about the uncached forward; else {DEFAULT_PREFILL_CHUNK}, DSA's fastest); the result "
                   "does not depend on it")
    p.add_argument("--compile", action="store_true",
                   help="run the decode, verification and draft steps as torch.compile graphs (static shapes, no "
                   "host synchronisation; attention models only): about 4x faster per token on CPU, after a one-off "
                   "compilation of about 5-30 s per graph (a speculative run compiles 3; reported as 'compile' in the "
                   "statistics; inductor caches it on disk for later runs). Same tokens as without it")
    p.add_argument("--json", action="store_true",
                   help="print one JSON line (model, prompt_ids, tokens, text, stats) to stdout at the end instead of "
                   "streaming")
    p.set_defaults(func=cmd_generate)


def prefill_chunk_arg(text: str) -> int | str:
    """--prefill-chunk's value: AUTO_CHUNK ("auto") or an integer (checked >= 1 in `cmd_generate`, naming the
    flag). Raises argparse.ArgumentTypeError for anything else."""
    if text == AUTO_CHUNK:
        return AUTO_CHUNK
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'{text!r}: an integer >= 1 or "{AUTO_CHUNK}"') from None


def cmd_generate(args: argparse.Namespace) -> int:
    from glm5lab.checkpoints.export import resolve_checkpoint
    from glm5lab.infer.generate import check_request, generate

    if args.draft_steps is not None and not args.speculative:
        raise ValueError("--draft-steps applies only with --speculative mtp")
    check_sampling_flags(args)
    if args.prefill_chunk != AUTO_CHUNK:
        validate.int_at_least("--prefill-chunk", args.prefill_chunk, 1)
    device = validate.torch_device(args.device, "--device")
    dtype = args.dtype or validate.default_dtype(device)
    folder = resolve_checkpoint(args.model, "--model")
    config = ModelConfig.from_hf(folder)  # a foreign or malformed config.json is refused before loading weights
    if args.compile:
        from glm5lab.infer.compiled import check_attention_only

        check_attention_only(config.layers, "--compile")
    tokenizer = find_tokenizer(args.tokenizer, folder, Path(args.model))
    prompt_ids = encode_prompt(args, tokenizer)
    stops = parse_stops(args.stop or [], tokenizer)
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   speculative=args.speculative, stop_tokens=stops, index_cache_dtype=args.index_cache_dtype,
                   draft_steps=DEFAULT_DRAFT_STEPS if args.draft_steps is None else args.draft_steps,
                   prefill_chunk=args.prefill_chunk)
    check_request(config, prompt_ids, args.max_new_tokens, **options)  # the library's checks, before the weights

    if folder != Path(args.model):  # a run folder's latest checkpoint
        print(f"glm5lab generate: using {folder}", file=sys.stderr)
    stream = None if args.json else Stream(tokenizer, sys.stdout)
    try:
        model = load_model(folder, torch_dtype=validate.torch_dtype(dtype), device=device,
                           speculative=bool(args.speculative))
        out = generate(model, prompt_ids, args.max_new_tokens, **options, compile=args.compile,
                       on_tokens=None if stream is None else (lambda rows: stream.add(rows[0])))
    except KeyboardInterrupt:  # the text so far ends its line; `glm5lab.cli` then says "interrupted", exit 130
        if stream is not None and stream.ids:
            stream.close()
        raise
    tokens = out.tokens[0]
    if stream is not None:
        stream.close()
    else:
        text = tokenizer.decode(tokens, skip_special_tokens=False) if tokenizer is not None else None
        print(json.dumps({"model": str(folder), "prompt_ids": prompt_ids, "tokens": tokens, "text": text,
                          "stats": out.stats.as_dict()}))
    print(format_stats(out.stats, bool(args.speculative)), file=sys.stderr)
    return 0


def check_sampling_flags(args: argparse.Namespace) -> None:
    """Refuse --top-k / --top-p without --temperature > 0 (the default 0 is greedy, which they
    cannot restrict), in the CLI's names and before anything is loaded. Raises ValueError."""
    given = [f"{flag} {value:g}" for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    if given and args.temperature == 0:
        verb = "restricts" if len(given) == 1 else "restrict"
        raise ValueError(f"{' and '.join(given)} {verb} sampling, but --temperature is 0 (greedy, the default): "
                         "add --temperature T > 0 (e.g. --temperature 0.8), or drop "
                         f"{' and '.join(g.split()[0] for g in given)}")


def find_tokenizer(option: str | None, folder: Path, model_arg: Path):
    """The tokenizer from --tokenizer, else the checkpoint folder's (or the --model folder's)
    tokenizer.json, else None."""
    from glm5lab.data.tokenizer import TOKENIZER_FILE, load_tokenizer

    if option is not None:
        return load_tokenizer(Path(option))
    for place in (folder, model_arg):
        if (place / TOKENIZER_FILE).is_file():
            return load_tokenizer(place)
    return None


def encode_prompt(args: argparse.Namespace, tokenizer) -> list[int]:
    """The prompt's token ids, from --prompt (encoded) or --prompt-ids (parsed); ValueError when
    there is nothing to encode or parse. Whether the ids fit the model is `generate`'s check."""
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer and {args.model} has no tokenizer.json: pass "
                             "--tokenizer FILE, or give the prompt as token ids with --prompt-ids")
        ids = tokenizer.encode(args.prompt).ids
        if not ids:
            raise ValueError("--prompt encodes to no tokens: give a non-empty prompt")
    else:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--prompt-ids {args.prompt_ids!r} is not allowed: integers separated by spaces or "
                             "commas, e.g. \"1 2 3\"") from None
        if not ids:
            raise ValueError("--prompt-ids is empty: give at least one token id")
    return ids


def parse_stops(values: list[str], tokenizer) -> list[int]:
    """--stop values as token ids: an integer is an id; other text must be one token. Whether the
    ids fit the model is `generate`'s check."""
    stops = []
    for value in values:
        try:
            token = int(value)
        except ValueError:
            if tokenizer is None:
                raise ValueError(f"--stop {value!r}: text needs a tokenizer; give a token id instead") from None
            token = tokenizer.token_to_id(value)
            if token is None:
                ids = tokenizer.encode(value, add_special_tokens=False).ids
                if len(ids) != 1:
                    raise ValueError(f"--stop {value!r} is {len(ids)} tokens {ids}: a stop must be a single token "
                                     "(or its id)") from None
                token = ids[0]
        stops.append(token)
    return stops


def load_model(folder: Path, *, torch_dtype, device, speculative: bool):
    """The model, with its MTP layer only when speculative decoding needs it. A config without an
    MTP layer loads as is (`generate` then refuses speculative="mtp"); one that declares an MTP
    layer whose weights the checkpoint lacks is a ValueError (the user's folder, not a bug)."""
    from glm5lab.hf import MissingMTPWeights
    from glm5lab.model.model import GLM5ForCausalLM

    try:
        model = GLM5ForCausalLM.from_pretrained(folder, dtype=torch_dtype, device=device, mtp=speculative)
    except MissingMTPWeights:
        raise ValueError(f"--speculative mtp needs the MTP layer's weights: {folder}/config.json declares an MTP "
                         "layer but the checkpoint has no weights for it (transformers does not save it)") from None
    return model.eval()


class Stream:
    """Writes generated text as it comes: decodes all tokens so far and prints the new suffix, so a multi-byte
    character split over tokens appears once complete (a trailing U+FFFD, an incomplete UTF-8 sequence, is held
    back until the next token or the end). Without a tokenizer, prints the token ids separated by spaces."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = ""

    def add(self, ids: list[int]) -> None:
        if not ids:
            return
        self.ids += ids
        text = (" ".join(map(str, self.ids)) if self.tokenizer is None
                else self.tokenizer.decode(self.ids, skip_special_tokens=False))
        if not text.endswith(REPLACEMENT_CHAR):
            self._show(text)

    def close(self) -> None:
        if self.tokenizer is not None:
            self._show(self.tokenizer.decode(self.ids, skip_special_tokens=False))
        self._write("\n")

    def _show(self, text: str) -> None:
        # byte-level BPE decoding only appends; should a tokenizer rewrite earlier text, the
        # already printed part stays and only what lies past it is printed
        self._write(text[len(self.shown):])
        self.shown = text

    def _write(self, s: str) -> None:
        if s:
            self.out.write(s)
            self.out.flush()


def format_stats(stats, speculative: bool = False) -> str:
    """The stderr statistics line. With speculative decoding, acceptance length and rate per draft position
    (`glm5lab.infer.speculative.AcceptanceStats`), or a note when the run ended before any verification step."""
    line = (f"{stats.new_tokens} new token{'' if stats.new_tokens == 1 else 's'}, decode {stats.decode_tokens_per_second:.1f} tok/s "
            f"({stats.decode_seconds:.3f} s), prefill {stats.prefill_seconds:.3f} s ({stats.prompt_tokens} "
            "prompt tokens)")
    if stats.compile_seconds:
        tokens = stats.compile_tokens
        line += (f", compile {stats.compile_seconds:.1f} s (the rounds that compiled, {tokens} token"
                 f"{'' if tokens == 1 else 's'}: apart, in neither the decode seconds nor the tok/s)")
    if stats.acceptance_length is not None:
        rates = " ".join(f"{r:.2f}" for r in stats.acceptance_rate)
        line += (f"; acceptance length {stats.acceptance_length:.2f} over {stats.verify_steps} verify steps, "
                 f"acceptance rate per draft position: {rates}")
    elif speculative:
        line += "; no verify step (the run ended with the first token), so no acceptance statistics"
    return line
