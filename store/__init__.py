"""The content-addressed store: digests, parallel hashing, blobs, encodings, backends."""

from flare.store.blobs import BlobInfo, BlobStore, PutResult
from flare.store.digest import Digest
from flare.store.encoding import Encoding
from flare.store.reports import StoreUsage, VerifyReport

__all__ = ["BlobInfo", "BlobStore", "Digest", "Encoding", "PutResult", "StoreUsage", "VerifyReport"]
