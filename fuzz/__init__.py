"""Coverage-guided fuzzing (atheris) of the parsers that take bytes from anyone: `make fuzz`.

One harness per parser (v1_body, v2_framing, grpc_infer), each with its corpus in
fuzz/corpus/<harness>/; fuzz/run.py runs them for a bounded time;
tests/service/wire/test_fuzz_corpus.py replays every corpus file without atheris.
fuzz/support.py says what a finding is.
"""
