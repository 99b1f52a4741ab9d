"""A schemathesis run of the HTTP API, from its own /openapi.json, against real `flare serve`
processes (the tiny Llama and MiniLM): requests that fit the document and requests that do
not, the boundary values of every field (schemathesis' coverage phase) and random ones (its
fuzzing phase). No request may get a 5xx; every answer must be one the document lists, of the
media type and with the body it describes (each event of a stream included); a request the
document rules out must be refused; a method a route does not take gets 405 and `Allow`.

The short run is seeded and part of the suite. The long one is left out unless asked for:

    python -m pytest -m long tests/test_openapi_fuzz.py

`FLARE_FUZZ_SEED=N` runs either with another seed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_serve import Server, build_home, flare_env

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "negative_data_rejection",
    "unsupported_method",
)
"""Not `positive_data_acceptance`: a request can fit the document and still be refused with a
400 the document lists (a prompt longer than the context, an empty prompt)."""
SHORT, LONG = 10, 500
"""Random examples per operation in the fuzzing phase (the coverage phase adds its own)."""
SEED = int(os.environ.get("FLARE_FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_home(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module", params=["tiny", "minilm"])
def server(home: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """Each model behind its own server; a 32-token context keeps generations short."""
    running = Server(flare_env(home), request.param, "--kv-cache-tokens", "32")
    yield running
    running.stop()


def test_no_generated_request_gets_a_server_error(server: Server, tmp_path: Path) -> None:
    fuzz(server, SHORT, tmp_path)


@pytest.mark.long
def test_no_generated_request_gets_a_server_error_long(server: Server, tmp_path: Path) -> None:
    fuzz(server, LONG, tmp_path)


def fuzz(server: Server, examples: int, scratch: Path) -> None:
    """schemathesis' own command on the server's document; its report (each failure with the
    request that caused it, as a curl command) is the assertion's message."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            f"{server.root}/openapi.json",
            f"--checks={','.join(CHECKS)}",
            f"--max-examples={examples}",
            f"--seed={SEED}",
            "--phases=coverage,fuzzing",
            "--workers=1",
            "--request-timeout=60",
            "--generation-database=none",
            "--suppress-health-check=all",
            "--no-color",
        ],
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:]
