"""The tap's local mode and /metrics under scrapers (bench/tap.py --local, --metrics; a
benchmark, never a test).

    .venv/bin/python bench/tap.py --local                 # MiniLM, batch 8 x 128, CPU
    .venv/bin/python bench/tap.py --local --device cuda   # on a GPU
    .venv/bin/python bench/tap.py --metrics               # /metrics at full cardinality

--local: AttentionTap(compute="local") on all-MiniLM-L6-v2 (bench/tap.py's model and batch),
sending to a service started here (its statistics only: POST /v1/health/observe). Measured
directly, never derived:
- every=1: forwards alternated one by one, untapped and tapped (its statistics' post included:
  the flush is timed with the forward), --pairs rounds; the overhead is the median of the
  rounds' ratios, with its quartiles (the spread). With --chunked each round also times a
  tapped forward whose statistics take sdpa_core's chunked path (the flash kernel unavailable
  to it): the tap before it loaded the CPU flash kernel, in the same conditions;
- every=100: blocks of 100 forwards alternated, untapped and tapped with every=100 (one sampled
  forward in each block: the block's first), --blocks of each; the median ratio and its range;
- bytes sent per sampled layer: the observe body's size over the layers in it (compared with
  what compute="service" sends: q, k, v and the mask of a layer).
--metrics: a service whose health registry holds 256 tags x 64 heads (SDPA_HEALTH_MAX_TAGS,
SDPA_HEALTH_MAX_HEADS, filled through /v1/health/observe), a bystander sending small attention
requests one after another: its p50 alone, then while eight clients scrape /metrics in a loop.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.support import live_server  # noqa: E402
from bench.tap import load_model, make_batch, timed  # noqa: E402
from sdpa_client.tap import AttentionTap  # noqa: E402


def quartiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {"p25": round(q[0], 4), "median": round(q[1], 4), "p75": round(q[2], 4),
            "min": round(min(values), 4), "max": round(max(values), 4)}  # fmt: skip


@contextmanager
def chunked_path() -> Iterator[None]:
    """sdpa_core's chunked path for the statistics computed in this thread: the Triton kernel
    alone allowed, which takes no CPU tensors without TRITON_INTERPRET, so the flash path is
    unavailable and attention() takes the chunked one."""
    from sdpa_core.kernels import TRITON_KERNEL, use_kernel

    with use_kernel(TRITON_KERNEL):
        yield


def local(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, model_name = load_model(random_weights=False, device=args.device)
    batch = make_batch(args.batch, args.tokens, args.device)

    def forward() -> None:
        with torch.no_grad():
            model(**batch)

    env = {
        "SDPA_HEALTH_SAMPLE_RATE": "0",
        "SDPA_LOG_LEVEL": "warning",
        "SDPA_COMPILE_KERNELS": "false",
    }
    with tempfile.TemporaryDirectory() as tmp, live_server(env, tmp_path=Path(tmp)) as server:
        for _ in range(3):
            forward()
        every1 = AttentionTap(server.url, model="bench-local-1", every=1, compute="local")
        # The arms of each round: untapped, tapped, and with --chunked tapped on sdpa_core's
        # chunked path (what the tap ran before it loaded the CPU flash kernel).
        arms = ["untapped", "tapped"] + (["chunked"] if args.chunked else [])
        ratios: dict[str, list[float]] = {arm: [] for arm in arms[1:]}
        # The same ratios in this process's CPU time (every thread's, the sender's included): on
        # a machine shared with other work the wall clock measures the neighbours as much as
        # the tap; CPU time much less (what it still counts: OpenMP workers spinning while one
        # of them waits for a core, caches shared).
        cpu_ratios: dict[str, list[float]] = {arm: [] for arm in arms[1:]}
        with every1.attach(model):
            if args.chunked:
                with chunked_path():
                    forward()
            forward()  # warm-up of the statistics' path (the last: local_kernel names it)
        every1.flush(60)
        kernel = every1.local_kernel
        for i in range(args.pairs):
            t: dict[str, float] = {}
            cpu: dict[str, float] = {}
            # Rotate which goes first, so a drift falls on each alike; attaching is untimed.
            for which in arms[i % len(arms) :] + arms[: i % len(arms)]:
                started_cpu = time.process_time()
                if which == "untapped":
                    t[which] = timed(forward, args.device)
                    cpu[which] = time.process_time() - started_cpu
                    continue
                # The sender posts after the forward (Sender.hold); the flush is timed with it:
                # back to back, that post would run beside the next forward, and here it must
                # land on no other arm's (the post counted whole, as if it overlapped nothing).
                with every1.attach(model), chunked_path() if which == "chunked" else nullcontext():
                    t[which] = timed(lambda: (forward(), every1.flush(60)), args.device)
                cpu[which] = time.process_time() - started_cpu
            for arm in ratios:
                ratios[arm].append(t[arm] / t["untapped"] - 1)
                cpu_ratios[arm].append(cpu[arm] / cpu["untapped"] - 1)
            print(f"every=1 round {i}: " + ", ".join(
                f"{a} {t[a] * 1e3:.0f} ms ({cpu[a] * 1e3:.0f} CPU)" for a in arms
            ), file=sys.stderr, flush=True)  # fmt: skip
        every1.flush(60)
        body = every1.last_body_bytes
        stats1 = every1.stats
        every1.close()

        blocks: list[float] = []
        block_ms: dict[str, list[float]] = {"untapped": [], "tapped": []}
        every100 = AttentionTap(
            server.url, model="bench-local-100", every=args.block, compute="local"
        )
        for i in range(args.blocks):
            order = ("tapped", "untapped") if i % 2 else ("untapped", "tapped")
            t = {}
            for which in order:
                if which == "tapped":
                    with every100.attach(model):
                        t[which] = timed(
                            lambda: [forward() for _ in range(args.block)], args.device
                        )
                else:
                    t[which] = timed(lambda: [forward() for _ in range(args.block)], args.device)
            every100.flush(60)
            blocks.append(t["tapped"] / t["untapped"] - 1)
            print(f"every=100 block {i}: {t['untapped']:.2f} -> {t['tapped']:.2f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            for which, seconds in t.items():
                block_ms[which].append(seconds * 1e3 / args.block)  # ms per forward
        stats100 = every100.stats
        every100.close()
    q, k, v = (batch["input_ids"].shape[0] * 12 * args.tokens * 32 * 4,) * 3
    figures: dict[str, Any] = {
        "model": model_name,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": f"batch {args.batch} x {args.tokens} tokens",
        "statistics_path": kernel,
    }
    for arm, name in (("tapped", "every_1"), ("chunked", "every_1_chunked_path")):
        if arm in ratios and args.pairs:  # --pairs 0: every=N alone
            figures[name] = {
                "rounds": args.pairs,
                "overhead": quartiles(ratios[arm]),
                "overhead_cpu_time": quartiles(cpu_ratios[arm]),
            }
    if args.blocks:  # --blocks 0: every=1 alone
        figures[f"every_{args.block}"] = {
            "blocks": args.blocks,
            "overhead": quartiles(blocks),
            "ms_per_forward": {k_: round(statistics.median(v_), 2) for k_, v_ in block_ms.items()},
        }
    figures["bytes_per_sampled_layer"] = round(body / 6)
    figures["service_mode_bytes_per_layer"] = q + k + v
    figures["counts"] = {"every_1": repr(stats1), f"every_{args.block}": repr(stats100)}
    return figures


def _scrape(url: str, stop: Any, count: Any) -> None:
    """Eight clients scraping /metrics in a loop until `stop` (in a process of their own)."""

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            while not stop.is_set():
                client.get("/metrics")
                with count.get_lock():
                    count.value += 1

    threads = [threading.Thread(target=loop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def metrics(args: argparse.Namespace) -> dict[str, Any]:
    tags, heads = 256, 64
    env = {
        "SDPA_HEALTH_SAMPLE_RATE": "0",
        "SDPA_LOG_LEVEL": "warning",
        "SDPA_COMPILE_KERNELS": "false",
        "SDPA_HEALTH_MAX_TAGS": str(tags),
        "SDPA_HEALTH_MAX_HEADS": str(heads),
    }
    fields = ("entropy", "normalized_entropy", "max_weight", "sink_share",
              "score_abs_max_scaled", "saturated_fraction")  # fmt: skip
    per_head = {key: [[0.5] * heads] for key in fields}
    observations = [
        {"tag": f"m/layer{i}", "visible_keys_max": 16, "per_head": per_head} for i in range(tags)
    ]
    eye = [[[1.0, 0.0], [0.0, 1.0]]]
    small = {"q": eye, "k": eye, "v": eye, "diagnostics": "none"}
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server(env, tmp_path=Path(tmp)) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        answer = client.post("/v1/health/observe", json={"observations": observations})
        assert answer.status_code == 200, answer.text
        page = client.get("/metrics")
        size, lines = len(page.content), page.text.count("\n")

        def bystander(seconds: float) -> list[float]:
            out: list[float] = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                start = time.perf_counter()
                assert client.post("/v1/attention", json=small).status_code == 200
                out.append(time.perf_counter() - start)
            return out

        idle = bystander(args.seconds)
        # The scrapers in a process of their own: their reading must not take this one's GIL.
        stop = multiprocessing.Event()
        scrapes = multiprocessing.Value("i", 0)
        scrapers = multiprocessing.Process(target=_scrape, args=(server.url, stop, scrapes))
        scrapers.start()
        time.sleep(1.0)
        busy = bystander(args.seconds)
        stop.set()
        scrapers.join()
        rendered = client.get("/metrics").text
    renders = next(
        (float(line.rsplit(" ", 1)[1]) for line in rendered.splitlines()
         if line.startswith("sdpa_metrics_render_seconds_count")), 0.0,
    )  # fmt: skip
    render_sum = next(
        (float(line.rsplit(" ", 1)[1]) for line in rendered.splitlines()
         if line.startswith("sdpa_metrics_render_seconds_sum")), 0.0,
    )  # fmt: skip
    p50_idle, p50_busy = statistics.median(idle), statistics.median(busy)
    return {
        "cardinality": f"{tags} tags x {heads} heads",
        "metrics_bytes": size,
        "metrics_lines": lines,
        "render_s_mean": round(render_sum / max(renders, 1), 3),
        "renderings": renders,
        "scrapes_answered": scrapes.value,
        "bystander_p50_ms": {
            "idle": round(p50_idle * 1e3, 2),
            "8_scrapers": round(p50_busy * 1e3, 2),
        },
        "bystander_requests": {"idle": len(idle), "8_scrapers": len(busy)},
        "ratio": round(p50_busy / p50_idle, 2),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", action="store_true")
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=40, help="every=1: alternated rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: its own)")
    parser.add_argument(
        "--chunked", action="store_true",
        help="every=1: also a tapped forward on sdpa_core's chunked path in each round",
    )  # fmt: skip
    parser.add_argument("--blocks", type=int, default=6, help="every=100: blocks of each kind")
    parser.add_argument("--block", type=int, default=100, help="forwards per block (= every)")
    parser.add_argument("--seconds", type=float, default=10.0, help="--metrics: per phase")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0))}
    if args.local:
        figures["local"] = local(args)
    if args.metrics:
        figures["metrics"] = metrics(args)
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
