"""Sign: publisher keys, signing, verification, trust policy.

The check every reader runs is `flare.sign.verify.check_trusted`; a registry's signatures of a
package are `Registry.signatures(digest)` (files under `signatures/` in the store).
"""

from flare.sign.envelope import sign_package
from flare.sign.errors import UntrustedError
from flare.sign.keys import KeyType, fingerprint, generate_key, load_private_key
from flare.sign.policy import TrustedPublisher, TrustPolicy, load_policy
from flare.sign.verify import Verdict, check_trusted

__all__ = [
    "KeyType",
    "TrustPolicy",
    "TrustedPublisher",
    "UntrustedError",
    "Verdict",
    "check_trusted",
    "fingerprint",
    "generate_key",
    "load_policy",
    "load_private_key",
    "sign_package",
]
