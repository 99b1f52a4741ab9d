"""The content-addressed store: digests, parallel hashing, blobs, encodings, backends."""

from flare.store.blobs import BlobInfo, BlobStore, PutResult, StoreUsage, VerifyReport
from flare.store.digest import Digest
from flare.store.encoding import Encoding

__all__ = ["BlobInfo", "BlobStore", "Digest", "Encoding", "PutResult", "StoreUsage", "VerifyReport"]
