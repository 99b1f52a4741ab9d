"""`flare serve` loads only what was signed: hostile packages and a rotting host cache.

A hostile publisher (a trusted key) signs indexes whose manifests lie about their own parts;
a disk flips bytes in the host cache after a pull. Each must end serve with exit 6 and one
line naming the part, before any weight serves; a corrupt cached blob goes to quarantine and
the next pull brings it back.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import CliHome

from flare.build.tiny import make_tiny_llama
from flare.store.package import (
    MANIFEST_KEY,
    Payload,
    canonical_json,
    check_payload,
    decode_index,
)
from flare.store.safetensors import FormatError, TensorSpec, encode_header, read_header

CORRUPT = 6
Manifest = dict[str, Any]


class Host(CliHome):
    """A FLARE_HOME with alice's key and the tiny Llama built, signed and pulled."""

    def serve(self, ref: str, code: int) -> str:
        """`flare serve REF` that must fail with `code`; its one-line error."""
        return self.run("serve", ref, "--port", "0", "--device", "cpu", code=code).stderr

    def manifest(self) -> Manifest:
        return json.loads(self.run("registry", "show", "tiny", "--json").stdout)["manifest"]

    def put(self, name: str, data: bytes) -> dict[str, Any]:
        """Store bytes in the registry; their digest and size, as a manifest entry gives them."""
        path = self.root / "crafted" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        put = json.loads(self.run("store", "put", "--json", str(path)).stdout)[0]
        return {"digest": put["digest"], "size": put["size"]}

    def publish_lie(self, name: str, lie: Callable[[Manifest], None]) -> str:
        """Sign, with alice's trusted key, an index whose manifest `lie` changed; its digest."""
        manifest = self.manifest()
        lie(manifest)
        index = encode_header([], {MANIFEST_KEY: canonical_json(manifest)})
        digest = self.put(f"{name}.index", index)["digest"]
        self.run("sign", digest)
        return digest

    def cached(self, digest: str) -> Path:
        hex_digest = digest.removeprefix("blake3:")
        return self.root / "packages" / "blobs" / "blake3" / hex_digest[:2] / hex_digest

    def registry_blob(self, digest: str) -> Path:
        hex_digest = digest.removeprefix("blake3:")
        return self.root / "registry" / "blobs" / "blake3" / hex_digest[:2] / hex_digest

    def quarantine(self) -> list[Path]:
        """What the host cache's quarantine holds."""
        folder = self.root / "packages" / "quarantine"
        return sorted(folder.iterdir()) if folder.exists() else []

    def pulled(self) -> dict[str, int]:
        """`flare pull tiny`: how many blobs came by which method."""
        done = self.run("pull", "tiny", "--device", "cpu", "--json")
        return json.loads(done.stdout)["blobs"]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    lab = Host(tmp_path_factory.mktemp("load-verify"))
    lab.run("key", "generate", "--publisher", "alice")
    lab.run("build", str(make_tiny_llama(lab.root / "tiny-llama")), "--name", "tiny")
    lab.pulled()
    return lab


def rot(path: Path, offset: int) -> None:
    """Flip one bit of a cached blob as a failing disk would, in the cache's copy only: the
    pull hardlinked it to the registry's, so the rotten copy replaces the link."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    rotten = path.with_name(path.name + ".rotten")
    rotten.write_bytes(bytes(data))
    rotten.chmod(0o444)
    os.replace(rotten, path)


def artifact(manifest: Manifest, path: str) -> dict[str, Any]:
    return next(a for a in manifest["artifacts"] if a["path"] == path)


def point(manifest: Manifest, path: str, at: dict[str, Any]) -> None:
    """Make the artifact at `path` name another blob (its digest and size, consistently)."""
    artifact(manifest, path).update(digest=at["digest"], size=at["size"])


# -- a byte flipped in the host cache after pull -------------------------------------------------


@pytest.mark.parametrize(
    ("part", "where", "offset"),
    [
        ("payload 1 of 1", lambda m: m["payloads"][0], -2),  # a weight's bytes
        ("payload 1 of 1", lambda m: m["payloads"][0], 20),  # inside the safetensors header
        ("artifact tokenizer.json", lambda m: artifact(m, "tokenizer.json"), 10),
        ("artifact config.json", lambda m: artifact(m, "config.json"), 5),
    ],
    ids=["payload-data", "payload-header", "tokenizer", "config"],
)
def test_a_rotten_cached_blob_is_refused_quarantined_and_pulled_again(
    host: Host, part: str, where: Callable[[Manifest], dict[str, Any]], offset: int
) -> None:
    digest = where(host.manifest())["digest"]
    rot(host.cached(digest), offset)
    before = host.quarantine()
    error = host.serve("tiny", CORRUPT)
    assert f"error: {part} of package tiny (blob {digest}) is corrupt on this host" in error
    moved = [p for p in host.quarantine() if p not in before]
    assert len(moved) == 1 and moved[0].name.startswith(digest.removeprefix("blake3:"))
    assert f"moved it to {moved[0]}" in error
    assert "the next flare serve or flare pull fetches it again from the registry" in error
    assert not host.cached(digest).exists()
    assert host.pulled() == {"hardlink": 1}
    host.run("store", "verify", "--store", str(host.root / "packages"), digest)


def test_a_restored_package_serves_again(host: Host) -> None:
    payload = host.manifest()["payloads"][0]["digest"]
    rot(host.cached(payload), -2)
    host.serve("tiny", CORRUPT)
    host.pulled()
    server = subprocess.Popen(
        [sys.executable, "-m", "flare", "serve", "tiny", "--port", "0", "--device", "cpu"],
        env=host.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "serving tiny@" in (server.stdout.readline() if server.stdout else "")
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0


def test_a_rotten_cached_index_is_quarantined_and_written_again_by_pull(host: Host) -> None:
    digest = json.loads(host.run("registry", "show", "tiny", "--json").stdout)["digest"]
    rot(host.cached(digest), -1)
    before = host.quarantine()
    assert host.pulled() == {}
    moved = [p for p in host.quarantine() if p not in before]
    assert len(moved) == 1 and moved[0].name.startswith(digest.removeprefix("blake3:"))
    index = host.cached(digest).read_bytes()
    assert decode_index(index, "the cached index").name == "tiny"


# -- a signed manifest that lies about its parts -------------------------------------------------


def first_norm(manifest: Manifest) -> dict[str, Any]:
    """A small BF16 tensor of the payload: a lie about it keeps the payload's sizes plausible."""
    return next(t for t in manifest["payloads"][0]["tensors"] if t["name"].endswith("norm.weight"))


def new_artifact(path: str, data: bytes) -> Callable[[Host, Manifest], None]:
    """A lie that stores new bytes in the registry and makes the artifact at `path` them."""
    return lambda host, m: point(m, path, host.put(path.replace("/", "_"), data))


def new_config(change: Callable[[dict[str, Any]], object]) -> Callable[[Host, Manifest], None]:
    """A lie that replaces config.json by a changed copy of it (valid JSON, signed)."""

    def lie(host: Host, manifest: Manifest) -> None:
        blob = host.registry_blob(artifact(manifest, "config.json")["digest"])
        config = json.loads(blob.read_text())
        change(config)
        new_artifact("config.json", json.dumps(config).encode())(host, manifest)

    return lie


LIES: dict[str, tuple[Callable[[Host, Manifest], None], str]] = {
    "config-is-payload-bytes": (
        lambda _, m: point(m, "config.json", m["payloads"][0]),
        "error: artifact config.json of package tiny is not ",
    ),
    "tokenizer-is-chat-template": (
        lambda _, m: point(m, "tokenizer.json", artifact(m, "chat_template.jinja")),
        "error: artifact tokenizer.json of package tiny is not a tokenizer",
    ),
    "chat-template-does-not-parse": (
        new_artifact("chat_template.jinja", b"{% if messages %}never closed"),
        "error: artifact chat_template.jinja of package tiny holds a chat template that does "
        "not parse",
    ),
    "config-is-a-list": (
        new_artifact("config.json", b"[1, 2]"),
        "error: artifact config.json of package tiny is not a JSON object",
    ),
    "config-narrower-than-weights": (
        new_config(lambda c: c.update(hidden_size=32)),
        "error: artifact config.json of package tiny is refused: config.json: "
        "hidden_size is 32, but model.embed_tokens.weight in payload",
    ),
    "config-a-billion-layers": (
        new_config(lambda c: c.update(num_hidden_layers=10**9)),
        "error: artifact config.json of package tiny is refused: config.json: num_hidden_layers ",
    ),
    "config-without-hidden-size": (
        new_config(lambda c: c.pop("hidden_size")),
        "error: artifact config.json of package tiny is refused: config.json lacks hidden_size",
    ),
    "eos-not-a-token-id": (
        new_config(lambda c: c.update(eos_token_id=["<|endoftext|>"])),
        "error: artifact config.json of package tiny has eos_token_id ['<|endoftext|>'], which "
        "is not token ids",
    ),
    "payload-size": (
        lambda _, m: m["payloads"][0].update(size=10**18),
        "error: package tiny: payload 1 of 1 (blob {payload}) holds {size} bytes, the manifest "
        "says 1000000000000000000",
    ),
    "artifact-size": (
        lambda _, m: artifact(m, "tokenizer.json").update(size=7),
        "error: package tiny: artifact tokenizer.json (blob",
    ),
    "dtype-wider": (
        lambda _, m: first_norm(m).update(dtype="F64"),
        "error: payload 1 of 1 of package tiny: tensor {norm} is BF16[64], "
        "the manifest says F64[64]",
    ),
    "dtype-same-width": (
        lambda _, m: first_norm(m).update(dtype="F16"),
        "error: payload 1 of 1 of package tiny: tensor {norm} is BF16[64], "
        "the manifest says F16[64]",
    ),
    "shape-huge": (
        lambda _, m: first_norm(m).update(shape=[10**9, 10**9]),
        "error: package tiny: the tensors the manifest lists for payload 1 of 1 take",
    ),
    "tensor-renamed": (
        lambda _, m: first_norm(m).update(name="model.layers.0.rogue.weight"),
        "error: payload 1 of 1 of package tiny does not match its manifest (missing "
        "['model.layers.0.rogue.weight'], extra",
    ),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_signed_manifest_that_lies_about_a_part_is_refused(host: Host, lie: str) -> None:
    change, expected = LIES[lie]
    manifest = host.manifest()
    digest = host.publish_lie(lie, lambda m: change(host, m))
    quarantined = host.quarantine()
    error = host.serve(digest, CORRUPT)
    payload = manifest["payloads"][0]
    facts = {"payload": payload["digest"], "size": payload["size"]}
    assert expected.format(**facts, norm=first_norm(manifest)["name"]) in error
    assert error.endswith("; the package is malformed: ask its publisher to rebuild it\n")
    assert host.quarantine() == quarantined  # the blobs are sound: nothing is moved


@pytest.mark.parametrize("lie", ["tokenizer-is-chat-template", "eos-not-a-token-id"])
def test_a_lie_in_the_text_side_reaches_load_runtimes_caller(host: Host, lie: str) -> None:
    """`flare serve` finds these in its API process while the engine loads; the engine's own
    read runs on a thread beside the weights' (serve/package_text.py), and what it raises
    there must reach `load_runtime`'s caller as the same error, not hang or pass."""
    from flare.errors import FlareError
    from flare.serve.runtime import load_runtime

    change, expected = LIES[lie]
    digest = host.publish_lie(lie, lambda m: change(host, m))
    manifest = decode_index(host.registry_blob(digest).read_bytes(), "index")
    files = {str(d): host.registry_blob(str(d)) for d in manifest.blobs()}
    with pytest.raises(FlareError) as raised:
        load_runtime(manifest, files)
    assert expected.removeprefix("error: ") in str(raised.value)
    assert raised.value.exit_code == CORRUPT


def test_a_rotten_file_outside_a_cache_is_refused_and_left_in_place(
    host: Host, tmp_path: Path
) -> None:
    """load_runtime on plain files (no host cache to quarantine into) says which file."""
    from flare.errors import IntegrityError
    from flare.serve.runtime import load_runtime

    digest = json.loads(host.run("registry", "show", "tiny", "--json").stdout)["digest"]
    manifest = decode_index(host.registry_blob(digest).read_bytes(), "index")
    files = {str(d): host.registry_blob(str(d)) for d in manifest.blobs()}
    payload = manifest.payloads[0].digest
    files[payload] = tmp_path / "payload"
    files[payload].write_bytes(host.registry_blob(payload).read_bytes())
    rot(files[payload], -2)
    with pytest.raises(IntegrityError, match=f"replace {files[payload]} with a good copy"):
        load_runtime(manifest, files)
    assert files[payload].exists()


# -- the checks themselves -----------------------------------------------------------------------


def test_a_payload_whose_tensors_lie_in_another_order_than_listed_is_refused() -> None:
    specs = [TensorSpec("a.weight", "BF16", (4,)), TensorSpec("b.weight", "BF16", (4,))]
    data = encode_header(specs, {}) + bytes(16)
    header = read_header(io.BytesIO(data), len(data), "payload")
    listed = [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs]
    check_payload(header, payload_entry(listed), "payload")
    with pytest.raises(
        FormatError,
        match=r"tensor b.weight lies at bytes \[8, 16\) of the data, "
        r"the manifest's order puts it at \[0, 8\)",
    ):
        check_payload(header, payload_entry(listed[::-1]), "payload")


def payload_entry(tensors: list[dict[str, Any]]) -> Payload:
    entry = {"digest": "blake3:" + "0" * 64, "size": 1, "ranks": [0], "tensors": tensors}
    return Payload.model_validate_json(json.dumps(entry))
