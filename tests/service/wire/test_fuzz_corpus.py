"""The fuzzers' corpora (fuzz/corpus/<harness>/) replayed through their harnesses' checks,
without atheris: every input a fuzzer kept, and every input a finding was fixed for, must still
be answered with a prepared job or a client error (and the same one parsed whole and in
pieces). And the harnesses' own parts: what counts as a finding, and the structured mutators,
which otherwise run only under libFuzzer.
"""

from __future__ import annotations

import importlib.util
import random
from functools import cache, partial
from pathlib import Path

import pytest

from fuzz import grpc_infer, health_observe, v1_body, v2_framing
from fuzz import support as fuzz_support
from fuzz.mutate import mutate_json
from fuzz.support import CORPUS, Check, Finding, answer, same_answers
from sdpa_core.errors import ShapeError
from service.errors import FieldError, InvalidRequest, Unavailable

HARNESSES = {
    "v1_body": v1_body,
    "v2_framing": v2_framing,
    "grpc_infer": grpc_infer,
    "health_observe": health_observe,
}
TARGETS = {"grpc_infer": "service.serving.prepare_grpc"}


@cache
def check_of(harness: str) -> Check:
    target = TARGETS.get(harness)
    if target is not None and importlib.util.find_spec(target) is None:
        pytest.skip(f"{target} does not exist yet")
    check: Check = HARNESSES[harness].load()
    return check


def corpus_files() -> list[Path]:
    return sorted(path for harness in HARNESSES for path in (CORPUS / harness).iterdir())


def test_every_harness_has_a_corpus_of_seeds() -> None:
    for harness in HARNESSES:
        names = [path.name for path in (CORPUS / harness).iterdir()]
        assert sum(name.startswith("seed-") for name in names) >= 10, harness


def test_the_corpora_stay_light() -> None:
    """Committed in the repository: a few hundred KB at most (fuzz/run.py --merge minimizes)."""
    assert sum(path.stat().st_size for path in corpus_files()) < 600_000


# A float64 beyond float32's range cast to float32 (refused as not finite) warns on its way.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize(
    "path", corpus_files(), ids=lambda p: f"{p.parent.name}/{p.name}"
)  # fmt: skip
def test_corpus_input_gets_a_job_or_a_client_error(path: Path) -> None:
    check_of(path.parent.name)(path.read_bytes())


# ---- what a finding is -------------------------------------------------------------------


def test_client_errors_are_answers() -> None:
    refused = answer(lambda: (_ for _ in ()).throw(InvalidRequest("q: bad")))
    assert refused[:3] == ("refused", "InvalidRequest", "q: bad")
    error = ShapeError("ranks differ", param="q", expected="3-D", got="2-D")
    assert answer(lambda: (_ for _ in ()).throw(error))[:2] == ("refused", "ShapeError")
    assert answer(lambda: 3) == ("ok", 3)


def test_anything_else_is_a_finding() -> None:
    with pytest.raises(ValueError, match="boom"):
        answer(lambda: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(Finding, match="Unavailable"):
        answer(lambda: (_ for _ in ()).throw(Unavailable("busy", retry_after_s=1)))


def test_a_client_error_that_cannot_be_written_is_a_finding() -> None:
    """A lone surrogate (JSON's "\\ud800") cannot be encoded as UTF-8: the answer would be a
    500 while writing it."""
    bad = InvalidRequest("x", errors=[FieldError(loc=("v2", "inputs", "\ud800"), msg="x")])
    with pytest.raises(Finding, match="cannot be written"):
        answer(lambda: (_ for _ in ()).throw(bad))


def test_different_answers_whole_and_in_pieces_are_a_finding() -> None:
    same_answers(("ok", 1), ("ok", 1), what="x")
    with pytest.raises(Finding, match="different answers"):
        same_answers(("ok", 1), ("refused", "InvalidRequest", "no", ()), what="x")
    many = ("refused", "InvalidRequest", "many", ((("body",), "many", "too_many_values"),))
    same_answers(("ok", 1), many, what="x")  # the one refusal only the pieces make


# ---- the mutators ------------------------------------------------------------------------


def test_json_mutations_keep_json() -> None:
    body = (CORPUS / "v1_body" / "seed-attention-options").read_bytes()
    rng = random.Random(0)
    changed = 0
    for _ in range(300):
        out = mutate_json(body, rng, v1_body.WORDS)
        assert out is not None
        changed += out != body
        body = out if len(out) < 4096 else body
    assert changed > 250
    assert mutate_json(b"{not json", rng, v1_body.WORDS) is None


def test_v2_frames_carry_the_header_and_the_body() -> None:
    data = v2_framing.frame(1, b'{"inputs": []}', b"\x00\x01")
    assert v2_framing.request_of(data) == (b'{"inputs": []}\x00\x01', "14")
    assert v2_framing.request_of(v2_framing.frame(0, b"{}", b""))[1] is None
    assert v2_framing.request_of(b"{") == (b"{", None)  # too short for a frame: a bare body
    # Every form of the header is text HTTP can carry (latin-1).
    for form in range(len(v2_framing.FORMS)):
        length = v2_framing.request_of(v2_framing.frame(form, b"{}", b"ab"))[1]
        if length is not None:
            length.encode("latin-1")


def test_v2_fitting_makes_binary_data_match_the_header() -> None:
    data = (CORPUS / "v2_framing" / "seed-mask-float-binary").read_bytes()
    _, header, tail = v2_framing.unframe(data)
    fitted = v2_framing._fit(header, random.Random(1))
    assert fitted is not None
    assert len(fitted[1]) == len(tail)
    check_of("v2_framing")(v2_framing.frame(1, *fitted))


def test_grpc_mutations_keep_a_message() -> None:
    raw = (CORPUS / "grpc_infer" / "seed-mask-bool-raw").read_bytes()
    rng = random.Random(2)
    for _ in range(300):
        out = grpc_infer.mutate_message(raw, rng)
        assert out is not None
        raw = out if len(out) < 4096 else raw
    assert grpc_infer.mutate_message(b"\xff\xff\xff", rng) is None


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_regenerated_requests_reach_prepared_jobs() -> None:
    """The mutators that write a request's tensors anew write ones that fit together (mostly):
    the harnesses get past validation to sdpa_core's checks and the limits."""
    from service.serving.prepare import prepare_attention
    from service.serving.prepare_v2 import prepare_infer

    settings, cost = fuzz_support.settings(), fuzz_support.cost_model()
    rng = random.Random(3)
    v1 = [v1_body.regenerate(b'{"diagnostics": "full"}', rng) for _ in range(40)]
    answers = [answer(partial(prepare_attention, body, settings, cost)) for body in v1]
    assert sum(a[0] == "ok" for a in answers) >= 10
    v2 = [v2_framing.regenerate(b'{"id": "x"}', rng) for _ in range(40)]
    answers = [answer(partial(prepare_infer, h + t, str(len(h)), settings, cost)) for h, t in v2]
    assert sum(a[0] == "ok" for a in answers) >= 10
