"""sdpa-tap: a Hugging Face model's attention, watched live or captured to a file.

    sdpa-tap watch http://127.0.0.1:8000 --model PATH --text sentences.txt
    sdpa-tap capture --model PATH --text "The cat sat on the mat." --out capture.npz

`watch` runs the model over the text's lines in batches with an AttentionTap attached
(every forward sampled unless --every says otherwise) and prints each layer's summary, averaged
over the sampled forwards, as a table. `capture` runs one forward and saves every layer's q, k,
v and mask with the tokens, for the explorer; it needs no service.

The model is loaded with transformers' AutoModel and AutoTokenizer from a local folder (set
HF_HUB_OFFLINE=1 where the hub cannot be reached).
"""

from __future__ import annotations

import argparse
import importlib
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


def _load(model_path: str) -> tuple[Any, Any]:
    transformers = importlib.import_module("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModel.from_pretrained(model_path).eval()
    return tokenizer, model


def _lines(text: str, *, is_file: bool) -> list[str]:
    raw = Path(text).read_text(encoding="utf-8") if is_file else text
    lines = [line.strip() for line in raw.splitlines()]
    return [line for line in lines if line]


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
    if not Path(args.text).is_file():
        print(f"sdpa-tap: --text {args.text}: no such file", file=sys.stderr)
        return 2
    lines = _lines(args.text, is_file=True)
    if not lines:
        print(f"sdpa-tap: {args.text} has no non-empty line", file=sys.stderr)
        return 2
    tokenizer, model = _load(args.model)
    started = time.monotonic()
    with AttentionTap(
        args.url, model=args.name, every=args.every, api_key=args.api_key,
        protocol=args.protocol, timeout_s=args.timeout,
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
        print(
            f"\n{stats.forwards} forwards, {stats.sampled} attention calls sampled: "
            f"{stats.answered} answered, {stats.failed} failed, {stats.dropped} dropped "
            f"({time.monotonic() - started:.1f} s)"
        )
    if first_failure is not None:
        print(f"first failure: {first_failure}", file=sys.stderr)
    if not done or stats.answered == 0:
        print("sdpa-tap: the service answered no sample (see the counts above)", file=sys.stderr)
        return 1
    return 0


def capture(args: argparse.Namespace) -> int:
    lines = _lines(args.text, is_file=Path(args.text).is_file())
    if not lines:
        print("sdpa-tap: no text to run the model on", file=sys.stderr)
        return 2
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

    w = commands.add_parser("watch", help="run a model over text with the tap attached")
    w.add_argument("url", help="the service, e.g. http://127.0.0.1:8000")
    w.add_argument("--model", required=True, help="a local Hugging Face model folder")
    w.add_argument("--text", required=True, help="a text file: one sequence per line")
    w.add_argument("--name", default="model", help="the tags' model name (default: model)")
    w.add_argument("--every", type=_positive, default=1, help="sample every n-th forward")
    w.add_argument("--batch-size", type=_positive, default=8)
    w.add_argument("--max-length", type=_positive, default=128, help="tokens per sequence, at most")
    w.add_argument("--protocol", choices=("v1", "v2"), default="v1")
    w.add_argument("--api-key", default=None)
    w.add_argument("--timeout", type=float, default=10.0, help="seconds per sample")
    w.set_defaults(run=watch)

    c = commands.add_parser("capture", help="save one forward's q, k, v, masks and tokens")
    c.add_argument("--model", required=True, help="a local Hugging Face model folder")
    c.add_argument("--text", required=True, help="the text (or a file of lines)")
    c.add_argument("--out", required=True, help="the .npz file to write")
    c.add_argument("--max-length", type=_positive, default=128)
    c.set_defaults(run=capture)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
