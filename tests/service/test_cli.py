"""`sdpa-service` command line: settings precedence, healthcheck exit codes, analyze output."""

from __future__ import annotations

import argparse
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import sdpa_core
from service.cli import build_parser, main, parse_strategies, settings_from
from tests.support.live_server import free_port

# --- serve: flags override the environment ----------------------------------------------------


@pytest.fixture(autouse=True)
def _clean_sdpa_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("SDPA_"):
            monkeypatch.delenv(key)


def test_serve_defaults_come_from_the_settings() -> None:
    settings = settings_from(build_parser().parse_args(["serve"]))
    assert (settings.host, settings.port, settings.log_level) == ("127.0.0.1", 8000, "info")


def test_serve_reads_the_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDPA_PORT", "9000")
    monkeypatch.setenv("SDPA_HOST", "127.0.0.2")
    monkeypatch.setenv("SDPA_MAX_BATCH_SIZE", "7")
    env_only = settings_from(build_parser().parse_args(["serve"]))
    assert (env_only.host, env_only.port, env_only.max_batch_size) == ("127.0.0.2", 9000, 7)

    args = build_parser().parse_args(["serve", "--port", "9100", "--log-level", "WARNING"])
    flagged = settings_from(args)
    assert flagged.port == 9100
    assert flagged.log_level == "warning"
    assert (flagged.host, flagged.max_batch_size) == ("127.0.0.2", 7)  # untouched by flags


def test_serve_moves_or_turns_off_the_grpc_door(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    assert settings_from(parser.parse_args(["serve"])).grpc_port == 8001  # Triton's
    monkeypatch.setenv("SDPA_GRPC_PORT", "7001")
    assert settings_from(parser.parse_args(["serve"])).grpc_port == 7001
    assert settings_from(parser.parse_args(["serve", "--grpc-port", "9001"])).grpc_port == 9001
    assert settings_from(parser.parse_args(["serve", "--no-grpc"])).grpc_port == 0  # off
    with pytest.raises(SystemExit) as exited:  # one or the other
        parser.parse_args(["serve", "--no-grpc", "--grpc-port", "9001"])
    assert exited.value.code == 2


def _options(parser: argparse.ArgumentParser, prog: str) -> Iterator[tuple[str, argparse.Action]]:
    """(command, option) for every option a user can give, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{prog} {name}")
        elif action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
            yield prog, action


def test_every_option_s_help_says_its_default() -> None:
    """--help shows what a flag left out means (sdpa-service and sdpa-loadtest; the switches
    that only turn something on, and required options, have no default to say)."""
    from sdpa_client.loadtest import build_parser as loadtest_parser

    options = [*_options(build_parser(), "sdpa-service"), *_options(loadtest_parser(), "")]
    assert any("--grpc-port" in action.option_strings for _, action in options)
    for prog, action in options:
        if isinstance(action, argparse._StoreTrueAction) or action.required:
            continue
        assert "default" in (action.help or ""), f"{prog} {action.option_strings}: {action.help}"


def test_serve_help_shows_the_grpc_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "[--grpc-port GRPC_PORT | --no-grpc]" in shown
    assert "the gRPC door's port (SDPA_GRPC_PORT, default 8001; 0 = off)" in shown
    assert "without the gRPC door (the same as SDPA_GRPC_PORT=0)" in shown


def test_serve_with_a_bad_setting_exits_2_without_serving(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SDPA_MAX_BATCH_SIZE", "0")
    assert main(["serve", "--port", str(free_port())]) == 2
    assert "max_batch_size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("where", "secret"),
    [("env", "good-key,clé-secrète"), ("file", "# comment\ngood-key\nclé-secrète\n")],
)
def test_serve_refuses_an_api_key_no_client_could_send_without_printing_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    where: str,
    secret: str,
) -> None:
    # The server reads header values as Latin-1 and keys are UTF-8: "é" could never match.
    if where == "env":
        monkeypatch.setenv("SDPA_API_KEYS", secret)
    else:
        key_file = tmp_path / "keys"
        key_file.write_text(secret, encoding="utf-8")
        monkeypatch.setenv("SDPA_API_KEYS_FILE", str(key_file))
    assert main(["serve", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "key #2 holds a character other than printable ASCII" in err
    assert "secr" not in err  # neither the key nor the keys beside it
    assert "good-key" not in err


def test_serve_refuses_an_unreadable_api_keys_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("SDPA_API_KEYS_FILE", str(tmp_path / "missing"))
    assert main(["serve", "--port", str(free_port())]) == 2
    assert "SDPA_API_KEYS_FILE: cannot read" in capsys.readouterr().err


# --- healthcheck ------------------------------------------------------------------------------


@contextmanager
def _http_server(status: int) -> Iterator[int]:
    """A stdlib HTTP server on loopback that answers every GET with `status`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.server.paths.append(self.path)  # type: ignore[attr-defined]
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.paths = []  # type: ignore[attr-defined]
    # shutdown() waits for serve_forever's next poll: 0.5 s by default, at every test's end.
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize(("status", "code"), [(200, 0), (503, 1), (500, 1), (404, 1)])
def test_healthcheck_exit_code_follows_the_readiness_status(status: int, code: int) -> None:
    with _http_server(status) as port:
        assert main(["healthcheck", "--url", f"http://127.0.0.1:{port}/readyz"]) == code


def test_healthcheck_default_url_is_readyz_on_sdpa_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with _http_server(200) as port:
        monkeypatch.setenv("SDPA_PORT", str(port))
        assert main(["healthcheck"]) == 0
    # The same port with nothing listening any more: unhealthy.
    assert main(["healthcheck", "--timeout", "1"]) == 1


def test_healthcheck_refuses_non_http_urls(tmp_path: pytest.TempPathFactory) -> None:
    assert main(["healthcheck", "--url", "file:///etc/hostname"]) == 1


# --- analyze ----------------------------------------------------------------------------------


def test_parse_strategies() -> None:
    assert parse_strategies(None) is None
    assert parse_strategies(["sqrt_dk", "mine=12.5"]) == ["sqrt_dk", ("mine", 12.5)]
    for bad in ("mine=0", "mine=-1", "mine=abc", "=3", "x=inf"):
        with pytest.raises(Exception, match="strategy"):
            parse_strategies([bad])


def test_analyze_json_matches_a_float64_recomputation(capsys: pytest.CaptureFixture[str]) -> None:

    d_k, n = 64, 16
    argv = ["analyze", "--d-k", str(d_k), "--n", str(n), "--seed", "3", "--json",
            "--strategies", "none", "sqrt_dk", "half=2"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)

    q, k = sdpa_core.make_synthetic_qk(n_q=n, n_k=n, d_k=d_k, std=1.0, seed=3)
    raw = (q.double().reshape(n, d_k) @ k.double().reshape(n, d_k).T).flatten()  # [N_q * N_k]
    assert report["d_k"] == d_k
    assert report["raw_score_variance"] == pytest.approx(raw.var(unbiased=False).item(), rel=1e-4)
    assert report["recommended_divisor"] == pytest.approx(raw.std(unbiased=False).item(), rel=1e-4)

    by_name = {s["name"]: s for s in report["strategies"]}
    assert {"none", "sqrt_dk", "half"} <= set(by_name)
    assert by_name["none"]["divisor"] == pytest.approx(1.0)
    assert by_name["sqrt_dk"]["divisor"] == pytest.approx(math.sqrt(d_k))
    assert by_name["half"]["divisor"] == pytest.approx(2.0)
    for entry in by_name.values():
        scores = raw.reshape(n, n) / entry["divisor"]  # [N_q, N_k]
        p = torch.softmax(scores, dim=-1)
        entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
        assert entry["score_variance"] == pytest.approx(scores.var(unbiased=False).item(), rel=1e-4)
        assert entry["entropy"] == pytest.approx(entropy.mean().item(), rel=1e-3, abs=1e-6)
        assert entry["max_weight"] == pytest.approx(p.max(-1).values.mean().item(), rel=1e-3)


def test_analyze_table_lists_every_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "--d-k", "512", "--n", "16"]) == 0
    out = capsys.readouterr().out
    for name in ("none", "sqrt_dk", "dk", "dk_quarter", "two_sqrt_dk"):
        assert name in out
    assert "recommended divisor" in out
    assert "22.63" in out  # sqrt(512) = 22.627..., the sqrt_dk divisor


def test_analyze_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "--d-k", "0"]) == 2
    assert main(["analyze", "--d-k", "8", "--strategies", "mine=-2"]) == 2
    assert "strategy" in capsys.readouterr().err
