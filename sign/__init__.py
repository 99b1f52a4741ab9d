"""Sign: publisher keys, signing, verification, trust policy."""
