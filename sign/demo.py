"""The demo's development key: made under FLARE_HOME and trusted on first use, so that
`flare demo` signs and verifies as a real publisher does while the user's own signing key, if
any, is neither used nor touched."""

from __future__ import annotations

from collections.abc import Callable

from flare.config import Config
from flare.sign import keys
from flare.sign import policy as trust

DEMO_PUBLISHER = "flare-demo"


def development_key(config: Config, say: Callable[[str], None]) -> keys.PrivateKey:
    """The demo's key, made if absent, and trusted as DEMO_PUBLISHER in this host's policy
    (replacing an older demo key, left from a wiped FLARE_HOME, under the same name); `say`
    tells the user where a new key was made."""
    path = config.home / "demo" / "signing-key.pem"
    if not path.exists():
        keys.write_private_key(keys.generate_key(), path)
        say(f"made a development signing key {path}")
    key = keys.load_private_key(path)
    if trust.load_policy(config).by_fingerprint(keys.fingerprint(key)) is None:
        trust.update_policy(config["trust.file"], lambda policy: _trust_demo(policy, key))
    return key


def _trust_demo(policy: trust.TrustPolicy, key: keys.PrivateKey) -> trust.TrustPolicy:
    """Trust the demo key as DEMO_PUBLISHER (run under the trust file's lock, so a `flare
    trust` change made meanwhile is kept), replacing an older demo key of that name."""
    if policy.by_fingerprint(keys.fingerprint(key)) is not None:
        return policy
    if policy.by_name(DEMO_PUBLISHER) is not None:
        policy = trust.remove(policy, DEMO_PUBLISHER)
    return trust.add_key(policy, DEMO_PUBLISHER, keys.public_pem(key))
