"""Sign: publisher keys, signing, verification, trust policy.

The check every reader runs is `flare.sign.verify.check_trusted`; a registry's signatures of a
package are `Registry.signatures(digest)` (files under `signatures/` in the store). Nothing is
imported here, so that a command which only names an error (`flare.sign.errors`) does not
load the cryptography libraries.
"""
