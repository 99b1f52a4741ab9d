"""Trials of hostile inputs: requests to a live server, a damaged host cache, malformed
packages, links out of a checkpoint, absurd tensor shapes and a source that moves while read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from faults import checks
from faults.damage import spoil
from faults.lab import (
    Home,
)
from faults.serving import Server, hostile_requests
from faults.trial import Trial, verify_exact


def serve_requests(t: Trial, mode: str) -> None:
    """Hostile requests to a running server (items 1, 2, 3, 6): a sampling parameter that
    overflows among six ordinary completions, a lone surrogate, a 5 MB prompt while /health
    is polled, /openapi.json. Each gets its documented answer and harms no other request."""
    home = t.home(base=True)
    server = t.stack.enter_context(Server.start(home, "tiny"))
    if server.url is None:
        t.violate(f"the server did not start: {server.message()}", item=None)
        return
    hostile_requests(t, server)
    stopped = server.stop()
    if stopped not in (0, None):
        t.violate(f"the server exited {stopped} on SIGTERM", item=None)


def serve_cache(t: Trial, mode: str) -> None:
    """A byte flipped in a pulled payload in the host cache (item 4): serve refuses (exit 6)
    and quarantines it rather than serve the changed weights."""
    t.item = 4
    home = t.home(base=True)
    if not t.check(home.run("pull", "tiny", "--device", "cpu"), item=None):
        return
    manifest = checks.manifest(home.registry, checks.protected(home.registry)["tiny:latest"])
    assert manifest is not None
    victim = t.rng.choice(manifest["payloads"])["digest"][7:]
    path = checks.blob_path(home.cache, victim)
    assert path is not None
    copy = path.with_name(path.name + ".soak")
    shutil.copyfile(path, copy)  # a new inode: the registry's blob stays whole
    spoil(copy, "flip", t.rng)
    os.replace(copy, path)
    t.fault()
    server = t.stack.enter_context(Server.start(home, "tiny"))
    if server.url is not None:
        t.violate(f"serve loaded a payload whose bytes changed in the host cache ({victim[:12]})")
        return
    if server.returncode != 6 or "internal error" in server.err:
        t.violate(f"serve exited {server.returncode}, not 6: {server.message()}")
        return
    if not list((home.cache / "quarantine").glob(f"{victim}*")):
        t.violate(f"serve refused the changed payload {victim[:12]} but did not quarantine it")
        return
    t.caught()
    verify_exact(t, home, item=None)


MALFORMED = {
    "config-is-payload": "config.json is a payload blob",
    "tokenizer-is-template": "tokenizer.json is the chat template",
    "payload-size": "a payload is said to be 10^18 bytes",
    "dtype": "a payload's BF16 tensors are said to be F64",
}


def serve_malformed(t: Trial, mode: str) -> None:
    """A signed package whose manifest lies about its parts (item 5): serve refuses it with a
    clear error naming the part (exit 6), never an internal error, never serving it."""
    t.item = 5
    home = t.home(base=True)
    index = _malformed_index(home, mode)
    path = t.root / "index.bin"
    path.write_bytes(index)
    stored = home.run("store", "put", "--no-link", str(path), "--json")
    if not t.check(stored, item=None):
        return
    digest = stored.json()[0]["digest"]  # type: ignore[index]
    if not t.check(home.run("registry", "tag", digest, "bad:latest"), item=None):
        return
    if not t.check(home.run("sign", "bad"), item=None):
        return
    t.fault()
    server = t.stack.enter_context(Server.start(home, "bad"))
    if server.url is not None:
        t.violate(f"serve served a signed package where {MALFORMED[mode]}")
    elif server.returncode != 6 or "internal error" in server.err:
        t.violate(f"{MALFORMED[mode]}: serve exited {server.returncode}, not 6: {server.message()}")
    else:
        t.caught()


def _malformed_index(home: Home, mode: str) -> bytes:
    """tiny:latest's index with one lie in its manifest, encoded as flare encodes indexes."""
    from flare.store.package import Manifest, encode_index

    manifest = checks.manifest(home.registry, checks.protected(home.registry)["tiny:latest"])
    assert manifest is not None
    by_path = {a["path"]: a for a in manifest["artifacts"]}
    payload = manifest["payloads"][0]
    if mode == "config-is-payload":
        by_path["config.json"] |= {"digest": payload["digest"], "size": payload["size"]}
    elif mode == "tokenizer-is-template":
        template = by_path["chat_template.jinja"]
        by_path["tokenizer.json"] |= {"digest": template["digest"], "size": template["size"]}
    elif mode == "payload-size":
        payload["size"] = 10**18
    else:
        for tensor in payload["tensors"]:
            tensor["dtype"] = "F64"
    manifest["name"] = "bad"
    return encode_index(Manifest.model_validate_json(json.dumps(manifest)))


# -- build input -----------------------------------------------------------------------------


def build_link(t: Trial, mode: str) -> None:
    """A checkpoint with a link out of itself (item 10) is refused, naming the link and its
    target, and the target's bytes never become a blob; a hub-cache snapshot's links into its
    own repo folder still build."""
    t.item = 10
    home = t.home()
    if mode == "hub":
        t.fault()
        if _hub_snapshot_builds(t, home):
            t.caught()
        return
    source = t.root / "ck-linked"
    shutil.copytree(t.lab.source("ck"), source)
    secret = t.root / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_bytes(t.rng.randbytes(t.rng.randint(16, 4096)))
    link = source / t.rng.choice(["vocab.txt", "notes.txt", "sub/extra.json"])
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(secret)
    t.fault()
    done = home.run("build", str(source), "--name", "linked", "--json")
    leaked = checks.blob_path(home.registry, _hex_of(secret.read_bytes())) is not None
    if done.rc == 0 or leaked:
        t.violate(f"a link out of the checkpoint ({link.name} -> {secret}) was published", done)
    elif t.check(done, ok=tuple(range(2, 15))):
        named = str(link.relative_to(source)) in done.err and str(secret) in done.err
        if named:
            t.caught()
        else:
            t.violate("the refusal does not name the link and its target", done)


def _hub_snapshot_builds(t: Trial, home: Home) -> bool:
    revision = t.rng.randbytes(20).hex()
    repo = t.root / "hub" / "models--soak--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(t.lab.source("ck").iterdir()):
        blob = repo / "blobs" / _hex_of(file.read_bytes())
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    hub = {"FLARE_HUB_CACHE": str(t.root / "hub")}
    return t.check(home.run("build", "soak/tiny", "--name", "hub", env=hub))


def _hex_of(data: bytes) -> str:
    import blake3

    return blake3.blake3(data).hexdigest()


LAYERS = [10**9, 10**6, 2**31 - 1, 10**12]


def build_layers(t: Trial, mode: str) -> None:
    """config.json claims a billion layers (item 11): the build refuses within seconds, with a
    clear error, in bounded memory."""
    t.item = 11
    home = t.home()
    source = t.root / "ck-huge"
    shutil.copytree(t.lab.source("ck"), source)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = t.rng.choice(LAYERS)
    (source / "config.json").write_text(json.dumps(config))
    t.fault()
    done = home.run("build", str(source), "--name", "huge", timeout=10, memory_limit=3 << 30)
    if t.check(done, ok=(4, 6)):
        if done.seconds > 5:
            t.violate(f"the refusal took {done.seconds:.1f} s", done)
        else:
            t.caught()


def build_moved(t: Trial, mode: str) -> None:
    """The same checkpoint under another folder name builds to the same digest (item 12)."""
    t.item = 12
    home = t.home()
    moved = t.root / f"copy-{t.rng.randrange(10**6)}" / t.rng.choice(["model", "ckpt", "x"])
    shutil.copytree(t.lab.source("ck"), moved)
    t.fault()
    done = home.run(*t.lab.build_args("tiny", "ck", "r1"))
    moved_done = home.run("build", str(moved), "--name", "tiny", "--payload-size", "16K", "--json")
    if t.check(done) and t.check(moved_done):
        here, there = done.json()["digest"], moved_done.json()["digest"]  # type: ignore[index]
        if here != there:
            t.violate(f"{t.lab.source('ck')} builds to {here}, its copy at {moved} to {there}")
        else:
            t.caught()
